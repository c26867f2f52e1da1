"""The alignment batch: what the checker compares, and its on-disk dump format.

One row per sequence, padded to a common length ``T``. Logprobs are
token-aligned: ``rollout_logprobs[i, t]`` is the engine's log-probability of
``token_ids[i, t]`` given ``token_ids[i, :t]`` (the same convention as
``jaxrl.rollout.base.Conversation``), 0 where ``model_mask`` is 0.

The dump is a single ``.npz`` file (``AlignmentBatch.save`` / ``load``) holding
the arrays below plus ``meta_json`` (weight version, logprob kind, source), so
the trainer can save any training batch and ``jaxrl align report`` can read it
later on another machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import numpy as np

from jaxrl.errors import InputError, InputFileNotFoundError, one_line
from jaxrl.rollout.base import Conversation

FORMAT = "jaxrl.align.batch/1"
_REQUIRED = ("token_ids", "model_mask", "rollout_logprobs", "turn_ids", "prompt_lengths", "lengths")
_OPTIONAL = ("learner_logprobs",)


@dataclasses.dataclass(frozen=True)
class AlignmentBatch:
    """A padded batch of ``B`` sequences of at most ``T`` tokens.

    token_ids: [B, T] int32 token ids (padding after ``lengths[i]`` is ignored).
    model_mask: [B, T] bool, True on tokens the policy generated; never on
      prompt, tool/environment or padding tokens.
    rollout_logprobs: [B, T] float32, the engine's logprob on model tokens.
    learner_logprobs: [B, T] float32 or None, the learner's recompute of the
      same tokens (docs/losses.md#notation ``old_logp``); None until scored.
    turn_ids: [B, T] int32, model turn index from 0 on model tokens, -1 elsewhere.
    prompt_lengths: [B] int32, tokens before the first model token.
    lengths: [B] int32, real (unpadded) tokens per sequence.
    meta: JSON-serialisable facts about the source (weight_version, logprob_kind...).

    Construction validates everything and raises ``ValueError`` naming the
    sequence index, the position and the problem.
    """

    token_ids: np.ndarray
    model_mask: np.ndarray
    rollout_logprobs: np.ndarray
    turn_ids: np.ndarray
    prompt_lengths: np.ndarray
    lengths: np.ndarray
    learner_logprobs: np.ndarray | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("token_ids", np.asarray(self.token_ids, np.int32))
        set_("model_mask", np.asarray(self.model_mask).astype(bool))
        set_("rollout_logprobs", np.asarray(self.rollout_logprobs, np.float32))
        set_("turn_ids", np.asarray(self.turn_ids, np.int32))
        set_("prompt_lengths", np.asarray(self.prompt_lengths, np.int32))
        set_("lengths", np.asarray(self.lengths, np.int32))
        if self.learner_logprobs is not None:
            set_("learner_logprobs", np.asarray(self.learner_logprobs, np.float32))
        set_("meta", dict(self.meta))
        _validate(self)

    @property
    def num_sequences(self) -> int:
        return self.token_ids.shape[0]

    def with_learner_logprobs(self, learner_logprobs) -> "AlignmentBatch":
        """A copy carrying the learner's recompute, token-aligned: a [B, T] array, or one
        array per sequence holding exactly ``lengths[i]`` entries."""
        if isinstance(learner_logprobs, (list, tuple)):
            if len(learner_logprobs) != self.num_sequences:
                raise ValueError(f"learner logprobs are given for {len(learner_logprobs)} sequences but the batch "
                                 f"has {self.num_sequences}")
            padded = np.zeros(self.token_ids.shape, np.float32)
            for i, row in enumerate(learner_logprobs):
                row = np.asarray(row, np.float32)
                if row.shape != (self.lengths[i],):
                    raise ValueError(f"sequence {i}: the learner scored {row.size} tokens but the rollout sequence "
                                     f"has {self.lengths[i]}; both sources must score the same token sequence")
                padded[i, :row.size] = row
            learner_logprobs = padded
        learner = np.where(self.model_mask, np.asarray(learner_logprobs, np.float32), 0.0)
        return dataclasses.replace(self, learner_logprobs=learner)

    @classmethod
    def from_conversations(
        cls, conversations: Sequence[Conversation], meta: dict[str, Any] | None = None
    ) -> "AlignmentBatch":
        """Pads token-level conversations (prompt, model turns, tool tokens) into a batch."""
        if not conversations:
            raise ValueError("conversations is empty; pass at least one Conversation")
        for i, c in enumerate(conversations):
            lens = {k: len(getattr(c, k)) for k in ("token_ids", "model_mask", "turn_ids", "rollout_logprobs")}
            if len(set(lens.values())) != 1:
                raise ValueError(
                    f"sequence {i}: conversation fields have different lengths {lens}; "
                    "every field needs one entry per token"
                )
        lengths = np.array([len(c.token_ids) for c in conversations], np.int32)
        width = int(lengths.max())
        batch = len(conversations)
        token_ids = np.zeros((batch, width), np.int32)
        mask = np.zeros((batch, width), bool)
        logp = np.zeros((batch, width), np.float32)
        turns = np.full((batch, width), -1, np.int32)
        prompt_lengths = np.zeros(batch, np.int32)
        for i, c in enumerate(conversations):
            n = lengths[i]
            token_ids[i, :n] = c.token_ids
            mask[i, :n] = np.asarray(c.model_mask).astype(bool)
            logp[i, :n] = c.rollout_logprobs
            turns[i, :n] = c.turn_ids
            first = np.flatnonzero(mask[i, :n])
            prompt_lengths[i] = first[0] if first.size else n
        return cls(token_ids, mask, logp, turns, prompt_lengths, lengths, meta=meta or {})

    def save(self, path: str | os.PathLike) -> None:
        """Writes the batch to ``path`` (.npz, compressed)."""
        arrays = {k: getattr(self, k) for k in _REQUIRED}
        if self.learner_logprobs is not None:
            arrays["learner_logprobs"] = self.learner_logprobs
        meta = dict(self.meta, format=FORMAT)
        np.savez_compressed(path, meta_json=np.array(json.dumps(meta)), **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "AlignmentBatch":
        """Reads a dump written by ``save``.

        Every problem raises ``jaxrl.errors.InputError`` (a ValueError; ``InputFileNotFoundError``
        for a missing file) whose one-line message names the file and the problem: missing, a
        folder, not an .npz, truncated or corrupt, arrays missing, unexpected, of the wrong
        dtype or shape, or values the batch cannot hold (named by sequence and position).
        """
        name = os.fspath(path)
        fix = "write dumps with jaxrl.align.AlignmentBatch.save (or the trainer's logging.dump_batch_every)"
        if not os.path.exists(name):
            raise InputFileNotFoundError(f"batch dump {name!r} does not exist")
        if os.path.isdir(name):
            raise InputError(f"batch dump {name!r} is a folder, not an .npz file")
        try:
            with open(name, "rb") as f:
                magic = f.read(6)
        except OSError as e:
            raise InputError(f"batch dump {name!r} cannot be read ({one_line(e.strerror or e)})") from e
        if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):
            what = ("an empty file" if not magic else "a single .npy array" if magic.startswith(b"\x93NUMPY")
                    else "not a zip archive")
            raise InputError(f"batch dump {name!r} is not an .npz file ({what}); {fix}")
        try:
            with np.load(name, allow_pickle=False) as data:
                contents = {k: data[k] for k in data.files}
        except Exception as e:  # zipfile.BadZipFile, zlib.error, EOFError, ValueError (object arrays), OSError...
            raise InputError(f"batch dump {name!r} is truncated or corrupt: cannot read it as an .npz "
                             f"({type(e).__name__}: {one_line(e)}); {fix}") from e
        missing = [k for k in _REQUIRED + ("meta_json",) if k not in contents]
        if missing:
            raise InputError(f"batch dump {name!r} lacks arrays {missing}; it holds {sorted(contents)}. {fix}")
        unexpected = sorted(set(contents) - set(_REQUIRED + _OPTIONAL + ("meta_json",)))
        if unexpected:
            raise InputError(f"batch dump {name!r} holds unexpected arrays {unexpected}; {fix}")
        meta_json = contents.pop("meta_json")
        try:
            if meta_json.ndim != 0 or meta_json.dtype.kind not in "US":
                raise ValueError(f"a {meta_json.dtype} array of shape {meta_json.shape}, not a JSON string")
            meta = json.loads(str(meta_json))
            if not isinstance(meta, dict):
                raise ValueError(f"a JSON {type(meta).__name__}, not an object")
        except ValueError as e:
            raise InputError(f"batch dump {name!r}: meta_json is {one_line(e)}; {fix}") from e
        if meta.get("format") != FORMAT:
            raise InputError(f"batch dump {name!r} has format {meta.get('format')!r}, expected {FORMAT!r}")
        for key, value in contents.items():
            problem = _dtype_problem(key, value)
            if problem:
                raise InputError(f"batch dump {name!r}: {key} {problem}")
        try:
            return cls(meta=meta, **contents)
        except ValueError as e:
            raise InputError(f"batch dump {name!r}: {one_line(e, 500)}") from e


# Array -> dtype kinds a dump may store it as (numpy kind codes: b bool, i/u integer, f float).
_KINDS = {"token_ids": "iu", "model_mask": "biu", "turn_ids": "iu", "prompt_lengths": "iu", "lengths": "iu",
          "rollout_logprobs": "f", "learner_logprobs": "f"}
_KIND_NAMES = {"b": "bool", "iu": "integer", "biu": "bool or integer", "f": "floating-point"}


def _dtype_problem(key: str, value: np.ndarray) -> str | None:
    """Why ``value`` cannot be the dump's array ``key`` without changing its values, or None."""
    kinds = _KINDS[key]
    if value.dtype.kind not in kinds:
        return f"has dtype {value.dtype}; expected {_KIND_NAMES[kinds]}"
    if value.dtype.kind in "iu" and value.size:
        low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
        if key == "model_mask":
            low, high = 0, 1
        if value.min() < low or value.max() > high:
            return f"holds values outside [{low}, {high}] (min {value.min()}, max {value.max()})"
    return None


def _first_bad(row_condition: np.ndarray) -> int:
    return int(np.flatnonzero(row_condition)[0])


def _validate(b: AlignmentBatch) -> None:
    if b.token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [batch, time], got shape {b.token_ids.shape}")
    shape = b.token_ids.shape
    named = {"model_mask": b.model_mask, "rollout_logprobs": b.rollout_logprobs, "turn_ids": b.turn_ids}
    if b.learner_logprobs is not None:
        named["learner_logprobs"] = b.learner_logprobs
    for name, x in named.items():
        if x.shape != shape:
            if x.ndim == 2 and x.shape[0] == shape[0]:
                raise ValueError(
                    f"{name} has {x.shape[1]} positions per sequence but token_ids has {shape[1]} "
                    f"(shapes {x.shape} vs {shape}); both sources must score the same token sequences"
                )
            raise ValueError(f"{name} has shape {x.shape} but token_ids has shape {shape}")
    for name in ("prompt_lengths", "lengths"):
        if getattr(b, name).shape != (shape[0],):
            raise ValueError(f"{name} must have shape ({shape[0]},), got {getattr(b, name).shape}")
    positions = np.arange(shape[1])
    for i in range(shape[0]):
        n, p = int(b.lengths[i]), int(b.prompt_lengths[i])
        if not 0 <= n <= shape[1]:
            raise ValueError(f"sequence {i}: length {n} is outside [0, {shape[1]}]")
        if not 0 <= p <= n:
            raise ValueError(f"sequence {i}: prompt length {p} is outside [0, length {n}]")
        mask = b.model_mask[i]
        if mask[:p].any():
            t = _first_bad(mask[:p])
            raise ValueError(
                f"sequence {i}: model_mask marks prompt position {t} as a model token "
                f"(prompt length {p}); prompt tokens must have mask 0"
            )
        if mask[n:].any():
            t = n + _first_bad(mask[n:])
            raise ValueError(f"sequence {i}: model_mask marks padding position {t} (length {n}) as a model token")
        if (b.token_ids[i, :n] < 0).any():
            t = _first_bad(b.token_ids[i, :n] < 0)
            raise ValueError(f"sequence {i}, position {t}: negative token id {b.token_ids[i, t]}")
        if (b.turn_ids[i][mask] < 0).any():
            t = int(positions[mask][_first_bad(b.turn_ids[i][mask] < 0)])
            raise ValueError(f"sequence {i}, position {t}: a model token has turn id {b.turn_ids[i, t]}; expected >= 0")
        for name in ("rollout_logprobs", "learner_logprobs"):
            values = getattr(b, name)
            if values is None:
                continue
            row = values[i]
            bad_nan = mask & ~np.isfinite(row)
            if bad_nan.any():
                t = _first_bad(bad_nan)
                raise ValueError(
                    f"sequence {i}, position {t}: {name} is {row[t]} on a model token; "
                    "logprobs must be finite"
                )
            bad_pos = mask & (row > 0)
            if bad_pos.any():
                t = _first_bad(bad_pos)
                raise ValueError(
                    f"sequence {i}, position {t}: {name} is {row[t]:.6g} > 0 on a model token; "
                    "a log-probability is <= 0 (was a probability or a logit passed?)"
                )
