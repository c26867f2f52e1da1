"""Prompt and SFT datasets as Grain pipelines: validate, tokenise, shard, shuffle, batch, resume.

Rows are read and tokenised once at start-up (so every process agrees on which
rows are valid and the bad-row count is known before training); Grain then
shards row indices by process, shuffles them with a seed (a new permutation
each epoch), repeats and batches them. The iterator's state is a small dict
(``state()``/``restore()``) saved in every checkpoint, so a resumed run sees
exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import grain
import numpy as np

from jaxrl.data.sources import Row, read_rows
from jaxrl.data.tokenizer import encode_prompt
from jaxrl.errors import InputError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the prompts come from and how they are tokenised.

    train_files/eval_files: .jsonl or .parquet files. prompt_field / response_field:
    row fields holding the prompt and (SFT only) the target response: a string, or a
    conversation's turns after the prompt, ``[{"role": "model" | "environment", "text": ...}]``,
    trained on the model's turns only (``_encode_turns``). tokenizer: a
    local folder. max_prompt_tokens: longer prompts are bad rows (skipped, counted).
    max_response_tokens: SFT responses longer than this are bad rows. mixture: weights by the
    row field ``mixture_field`` (e.g. task -> weight): every batch draws from each group in that
    proportion (Grain's mixing), however many rows each has; empty = rows in one shuffled stream.
    """

    tokenizer: str = ""
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    prompt_field: str = "prompt"
    response_field: str = "response"
    use_chat_template: bool = True
    system_prompt: str | None = None
    max_prompt_tokens: int = 512
    max_response_tokens: int = 512
    shuffle: bool = True
    seed: int = 0
    mixture: dict[str, float] = dataclasses.field(default_factory=dict)
    mixture_field: str = "task"

    def __post_init__(self):
        if self.max_prompt_tokens < 1 or self.max_response_tokens < 1:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) and max_response_tokens "
                f"({self.max_response_tokens}) must be >= 1"
            )
        check_mixture("data.mixture", self.mixture)
        if not 0 <= self.seed < 2**32:  # grain's shuffle and numpy's RandomState take 32-bit seeds
            raise ValueError(f"seed must be in [0, 2**32 - 1], got {self.seed}")


def check_mixture(key: str, mixture) -> None:
    """ValueError naming ``key`` unless ``mixture`` maps names to weights >= 0 (0 leaves a group
    out, e.g. for one curriculum stage), at least one of them positive."""
    mixture = dict(mixture or {})
    for name, weight in mixture.items():
        if not (isinstance(weight, (int, float)) and weight >= 0):
            raise ValueError(f"{key}.{name} must be a weight >= 0, got {weight!r}")
    if mixture and not any(mixture.values()):
        raise ValueError(f"{key} gives every group weight 0; give at least one a positive weight")


@dataclasses.dataclass(frozen=True)
class Example:
    """A valid row: its prompt (text and ids), the SFT response ids (empty for RL) with their loss
    mask (1 on the tokens SFT trains on, 0 on an environment's), and the raw row."""

    prompt: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    row: dict[str, Any]
    where: str
    response_mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """How many rows were read, kept and skipped (by reason).

    bad_by_reason: reason -> rows skipped for it ("unreadable", "missing_field",
      "empty_prompt", "empty_response", "bad_turns", "too_long", or a reason given by ``row_check``).
    first_bad: reason -> the locations ("FILE line N" / "FILE row N") of its first
      few rows (at most ``FIRST_BAD``), over all files.
    """

    total_rows: int
    bad_rows: int
    bad_by_reason: dict[str, int]
    first_bad: dict[str, list[str]] = dataclasses.field(default_factory=dict)


FIRST_BAD = 5  # locations kept (and printed) per problem


class AllRowsBadError(InputError):
    """Every row of a dataset was invalid (or the files hold no rows)."""


# row_check(row) -> None (keep) or (reason, message) or (reason, message, detail): rows are counted
# under ``reason``; each (file, reason) gets one warning listing its distinct messages with their
# counts and first lines, so ``message`` should not vary from row to row; an optional ``detail``
# (e.g. the row's fields) is shown next to each line number.
RowCheck = Callable[[dict[str, Any]], "tuple[str, str] | tuple[str, str, str | None] | None"]


@dataclasses.dataclass(frozen=True)
class _Bad:
    """A bad row's problem: ``reason`` (counted), ``message`` (the same for every row with
    this problem, e.g. "missing field 'answer'") and ``detail`` (this row's specifics, or None)."""

    reason: str
    message: str
    detail: str | None = None


def _row_problem(row: Row, config: DataConfig, tokenizer, with_response: bool,
                 row_check: RowCheck | None) -> _Bad | Example:
    """An Example for a good row, else the problem."""
    if row.data is None:
        return _Bad("unreadable", row.error or "unreadable", row.detail)
    prompt = row.data.get(config.prompt_field)
    if config.prompt_field not in row.data:  # a null value is a field given empty, not a missing one
        return _Bad("missing_field", f"missing field {config.prompt_field!r}",
                    f"has fields {sorted(row.data)}")
    if not isinstance(prompt, str) or not prompt.strip():
        return _Bad("empty_prompt", f"empty or non-text field {config.prompt_field!r}", f"is {_short(prompt)}")
    prompt_ids = encode_prompt(
        tokenizer, prompt, use_chat_template=config.use_chat_template, system_prompt=config.system_prompt
    )
    if len(prompt_ids) > config.max_prompt_tokens:
        return _Bad("too_long", f"prompt longer than data.max_prompt_tokens={config.max_prompt_tokens}",
                    f"{len(prompt_ids)} tokens")
    response_ids: list[int] = []
    response_mask: list[int] = []
    if with_response:
        response = row.data.get(config.response_field)
        if config.response_field not in row.data:
            return _Bad("missing_field", f"missing field {config.response_field!r}",
                        f"has fields {sorted(row.data)}")
        if isinstance(response, list):
            turns = _encode_turns(tokenizer, response)
            if isinstance(turns, _Bad):
                return turns
            response_ids, response_mask = turns
        elif not isinstance(response, str) or not response:
            return _Bad("empty_response", f"empty or non-text field {config.response_field!r}",
                        f"is {_short(response)}")
        else:
            response_ids = list(tokenizer.encode(response, add_special_tokens=False)) + [tokenizer.eos_token_id]
            response_mask = [1] * len(response_ids)
        if len(response_ids) > config.max_response_tokens:
            return _Bad("too_long", f"response longer than data.max_response_tokens={config.max_response_tokens}",
                        f"{len(response_ids)} tokens")
    if row_check is not None:
        try:
            problem = row_check(row.data)
        except Exception as e:  # a bug in the check, not in the row: stop, but say which row it met
            e.add_note(f"while checking {row.where} with row_check={getattr(row_check, '__qualname__', row_check)}")
            raise
        if problem is not None:
            if not isinstance(problem, (tuple, list)) or len(problem) not in (2, 3):
                raise TypeError(f"row_check={getattr(row_check, '__qualname__', row_check)} returned {problem!r} "
                                f"for {row.where}; expected None, (reason, message) or (reason, message, detail)")
            reason, message, *detail = problem
            return _Bad(str(reason), str(message), str(detail[0]) if detail and detail[0] is not None else None)
    return Example(
        prompt=prompt,
        prompt_ids=np.asarray(prompt_ids, np.int32),
        response_ids=np.asarray(response_ids, np.int32),
        row=dict(row.data),
        where=row.where,
        response_mask=np.asarray(response_mask, np.int32),
    )


TURN_ROLES = ("model", "environment")


def _encode_turns(tokenizer, turns: list) -> tuple[list[int], list[int]] | _Bad:
    """An SFT response that is a conversation's turns after the prompt, each ``{"role": "model" |
    "environment", "text": ...}``: (token ids, loss mask). Each turn is encoded on its own, as a
    multi-turn rollout appends them (``jaxrl.env``): a model turn ends with eos, as the engine's
    turns do, and is trained on; an environment turn (e.g. a tool response, as the environment
    renders it) is encoded as is and masked out of the loss."""
    ids: list[int] = []
    mask: list[int] = []
    for turn in turns:
        if not (isinstance(turn, dict) and turn.get("role") in TURN_ROLES and isinstance(turn.get("text"), str)
                and turn["text"]):
            return _Bad("bad_turns", f"each response turn must be {{role: {' | '.join(TURN_ROLES)}, text: "
                        "non-empty string}", f"has {_short(turn)}")
        model = turn["role"] == "model"
        tokens = list(tokenizer.encode(turn["text"], add_special_tokens=False)) + (
            [tokenizer.eos_token_id] if model else [])
        ids += tokens
        mask += [int(model)] * len(tokens)
    if not any(mask):
        return _Bad("empty_response", "the response turns hold no model turn to train on",
                    f"roles {[turn['role'] for turn in turns]}")
    return ids, mask


def _short(value: Any, limit: int = 40) -> str:
    return "null" if value is None else _clip(repr(value), limit)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Problems:
    """The bad rows of one file, grouped by reason: counts, messages, first locations."""

    def __init__(self, path: str):
        self.path = path
        self.by_reason: dict[str, dict] = {}

    def add(self, row: Row, bad: _Bad) -> None:
        group = self.by_reason.setdefault(bad.reason, {"count": 0, "messages": {}, "unit": row.unit})
        group["count"] += 1
        message = group["messages"].setdefault(bad.message, {"count": 0, "first": []})
        message["count"] += 1
        if len(message["first"]) < FIRST_BAD:
            message["first"].append((row.index, bad.detail))

    def warnings(self) -> list[str]:
        """One line per reason: "skipped 37 rows of FILE: missing field 'answer' (lines 3, 9, 14, ...)"."""
        lines = []
        for group in self.by_reason.values():
            count, unit = group["count"], group["unit"]
            parts = [self._part(message, info, unit, several=len(group["messages"]) > 1)
                     for message, info in list(group["messages"].items())[:FIRST_BAD]]
            if len(group["messages"]) > FIRST_BAD:
                others = len(group["messages"]) - FIRST_BAD
                parts.append(f"and {others} other {'problem' if others == 1 else 'problems'}")
            lines.append(f"skipped {count} {'row' if count == 1 else 'rows'} of {self.path}: {'; '.join(parts)}")
        return lines

    @staticmethod
    def _part(message: str, info: dict, unit: str, several: bool) -> str:
        """ "missing field 'answer' (lines 3, 9, 14, ...)"; with details, "prompt longer than
        data.max_prompt_tokens=20 (line 4: 50 tokens; line 7: 61 tokens)", or one detail
        for all when they agree: "missing field 'prompt' (lines 2, 5: has fields ['q'])"."""
        first, more = info["first"], info["count"] > len(info["first"])
        counted = f"{info['count']} rows; " if several and info["count"] > 1 else ""
        details = {detail for _, detail in first}
        if len(details) > 1:
            shown = "; ".join(f"{unit} {n}" + (f": {_clip(detail)}" if detail else "") for n, detail in first)
            return f"{message} ({counted}{shown}{'; ...' if more else ''})"
        label = unit if len(first) == 1 and not more else unit + "s"
        (detail,) = details
        return (f"{message} ({counted}{label} {', '.join(str(n) for n, _ in first)}{', ...' if more else ''}"
                f"{f': {_clip(detail)}' if detail else ''})")


def load_examples(
    files: Sequence[str], config: DataConfig, tokenizer, *, with_response: bool = False,
    row_check: RowCheck | None = None,
) -> tuple[list[Example], LoadReport]:
    """Reads, validates and tokenises every row; bad rows are skipped, counted and warned about.

    row_check: called with each otherwise valid row's dict; returns None to keep it, or
      ``(reason, message)`` to skip it, counted under ``reason`` like the built-in problems
      (e.g. the reward router's ``row_problem``: the row's task has a reward function and the
      answer field it needs). A third element, if given, is a per-row detail shown next to
      each line number, so that ``message`` can stay the same from row to row.

    One warning per (file, reason): the count, each distinct message and its first few
    line/row numbers. Raises ``AllRowsBadError`` (an ``InputError``) when no row is usable, naming
    the files and the counts per reason; ``InputError`` for a missing or unreadable file
    and when no file is given.
    """
    if isinstance(files, (str, bytes)):
        files = [files]
    if not files:
        raise InputError("no data files given; set data.train_files to a list of .jsonl/.parquet files")
    examples: list[Example] = []
    bad_by_reason: dict[str, int] = {}
    first_bad: dict[str, list[str]] = {}
    total = 0
    for path in files:
        problems = _Problems(path)
        for row in read_rows(path):
            total += 1
            result = _row_problem(row, config, tokenizer, with_response, row_check)
            if isinstance(result, Example):
                examples.append(result)
                continue
            bad_by_reason[result.reason] = bad_by_reason.get(result.reason, 0) + 1
            locations = first_bad.setdefault(result.reason, [])
            if len(locations) < FIRST_BAD:
                locations.append(row.where)
            problems.add(row, result)
        for line in problems.warnings():
            log.warning("%s", line)
    report = LoadReport(total_rows=total, bad_rows=total - len(examples), bad_by_reason=bad_by_reason,
                        first_bad=first_bad)
    if not examples:
        names = ", ".join(map(str, files))
        if total == 0:
            raise AllRowsBadError(f"the data files {names} hold no rows; check data.train_files/data.eval_files")
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(bad_by_reason.items(), key=lambda kv: -kv[1]))
        raise AllRowsBadError(
            f"all {total} rows of {names} are bad ({counts}; first: "
            f"{'; '.join(f'{r}: {locs[0]}' for r, locs in first_bad.items())}); check data.prompt_field="
            f"{config.prompt_field!r}, data.max_prompt_tokens={config.max_prompt_tokens} and the warnings above"
        )
    return examples, report


class BatchIterator:
    """Endless batches of Examples: sharded by process, seeded shuffle per epoch, resumable.

    batch_size: examples per batch on this process. ``state()`` returns a plain dict;
    ``restore(state)`` continues exactly from there. ``mixture`` (name -> weight, over the
    examples' row field ``mixture_field``): each group is shuffled and repeated on its own and
    Grain interleaves them in the weights' proportion, so every batch holds each group's share
    (up to rounding), a small group repeating more often than a large one.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        mixture: dict[str, float] | None = None,
        mixture_field: str = "task",
    ):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
        shard = grain.MapDataset.range(len(examples))[process_index::process_count]
        if len(shard) < batch_size:
            raise InputError(
                f"a batch of {batch_size} prompts (rollout.prompts_per_step; sft.batch_size in SFT) exceeds the "
                f"{len(shard)} valid rows of process {process_index} ({len(examples)} over {process_count} "
                f"processes); lower the batch size or add data"
            )
        if mixture:
            stream = _mixed(examples, list(shard), mixture, mixture_field, seed if shuffle else None)
        else:
            stream = (shard.shuffle(seed=seed) if shuffle else shard).repeat(None)
        dataset = stream.batch(batch_size, drop_remainder=True, batch_fn=np.asarray)
        self.examples = list(examples)
        self._iterator = iter(dataset.to_iter_dataset())

    def __iter__(self):
        return self

    def __next__(self) -> list[Example]:
        return [self.examples[i] for i in next(self._iterator)]

    def state(self) -> dict:
        return dict(self._iterator.get_state())

    def restore(self, state: dict) -> None:
        self._iterator.set_state(dict(state))


def _mixed(examples: Sequence[Example], indices: list[int], mixture: dict[str, float], field: str,
           seed: int | None) -> grain.MapDataset:
    """The endless stream of example indices that interleaves the groups of ``mixture`` in
    proportion to their weights, each group shuffled (``seed`` not None) and repeated alone."""
    groups: dict[str, list[int]] = {name: [] for name in mixture}
    for i in indices:
        name = examples[i].row.get(field)
        if name is None:
            raise InputError(f"{examples[i].where}: data.mixture mixes by the row field {field!r}, which this row "
                             "lacks; add it or set data.mixture_field")
        if str(name) not in groups:
            raise InputError(f"{examples[i].where}: its {field} {name!r} has no weight in data.mixture "
                             f"{sorted(mixture)}; give it one or remove its rows")
        groups[str(name)].append(i)
    empty = [name for name, members in groups.items() if not members and mixture[name] > 0]
    if empty:
        raise InputError(f"data.mixture names {empty} but no valid row has that {field}; remove the names or "
                         "add rows")
    streams, weights = [], []
    for k, (name, members) in enumerate(groups.items()):
        if mixture[name] == 0:  # named, so not a typo, and left out
            continue
        stream = grain.MapDataset.source(members)
        streams.append((stream.shuffle(seed=seed + k) if seed is not None else stream).repeat(None))
        weights.append(float(mixture[name]))
    return grain.MapDataset.mix(streams, weights)
