"""The typed batch of one training step, from packing to the optimizer.

:class:`StepBatch` holds the step's sequences packed next-token aligned (column ``t`` holds
the input token at position ``t`` and scores ``targets[:, t]``, the token at ``t + 1``), and
gains its per-token arrays stage by stage through ``.replace(...)``: the engine's
``rollout_logp`` at packing, ``old_logp`` / ``ref_logp`` at the recompute, with a critic
(PPO with GAE) its ``values`` before the advantages, then ``advantages`` (and with GAE the
``token_rewards`` and the critic's targets ``returns``) after the reward. It is a frozen
pytree, so the same object goes to the host-side stages and,
sliced by :meth:`StepBatch.mini_batches`, into the jitted update as an :class:`UpdateBatch`.
:meth:`StepBatch.token_aligned` is the alignment checker's view of the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from jaxrl.align.dump import AlignmentBatch
from jaxrl.losses import loss_normalizer
from jaxrl.models.scoring import token_aligned
from jaxrl.models.packing import PackedRows, pack_rows

# The fields the loss reads; the rest (``generated``, ``prompt_lengths``) stay on the host.
_UPDATE_FIELDS = ("input_ids", "positions", "segment_ids", "targets", "mask", "rollout_logp", "old_logp", "ref_logp",
                  "advantages", "values", "returns", "routed_experts")


_loss_normalizer = jax.jit(loss_normalizer, static_argnums=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's packed sequences, each array [N, T] unless noted.

    input_ids, positions, segment_ids (1 = real token, 0 = padding), targets: int32 model inputs;
    mask: float32, 1 where the target is a completion token that enters the loss (a sample
    masked out after its reward, e.g. unparsable, is all zeros);
    generated: bool, every target the engine generated, masked samples included (the push check
    and the alignment dump need no reward);
    rollout_logp: float32, the engine's logprob of each generated target (0 elsewhere);
    prompt_lengths: int32 [N];
    old_logp, ref_logp, advantages: float32, filled in by the recompute and advantage stages
    (``None`` until then, and ``ref_logp`` stays ``None`` when nothing needs the reference);
    values, returns, token_rewards: float32, only with a critic (``advantage.estimator: gae``,
    ``jaxrl.trainer.stages.advantage.critic``; ``None`` otherwise): the critic's value at each column before the
    update (the value of the state before that column's target is generated:
    ``jaxrl.models.value``), the GAE targets, and the task's reward on each generated target
    (the score on the last one, or the reward function's per-token rewards) before any KL
    penalty; 0 off the ``mask``;
    routed_experts: int32 [N, T, MoE layers, k], for MoE engines that return their routes: the
    experts the engine used at each input column (-1 on padding), replayed by the learner's
    forwards with ``update.routing_replay`` (``None`` otherwise);
    turn_ids: int32, multi-turn samples only: the model turn of each target on the ``mask``, -1
    elsewhere (``None`` for single-turn samples).
    """

    input_ids: Any
    positions: Any
    segment_ids: Any
    targets: Any
    mask: Any
    generated: Any = None
    rollout_logp: Any = None
    prompt_lengths: Any = None
    old_logp: Any = None
    ref_logp: Any = None
    advantages: Any = None
    values: Any = None
    returns: Any = None
    token_rewards: Any = None
    routed_experts: Any = None
    turn_ids: Any = None

    @classmethod
    def pack(cls, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray], length: int, pad_id: int,
             rollout_logp: Sequence[np.ndarray] | None = None, model_masks: Sequence | None = None,
             turn_ids: Sequence | None = None) -> "StepBatch":
        """Right-padded rows ``prompt + completion`` of ``length`` next-token columns.

        ``mask`` and ``generated`` mark the completion's targets, or with ``model_masks[i]`` (per
        completion token, multi-turn samples: 0 on the environment's tokens) those of them the
        model generated; ``rollout_logp[i][j]`` (when given) lands at completion token j's
        target column, as ``turn_ids[i][j]`` (the model turn, -1 elsewhere) in ``turn_ids``. A
        sequence longer than ``length + 1`` tokens is an error naming it.
        """
        n = len(prompts)
        input_ids = np.full((n, length), pad_id, np.int32)
        targets = np.full((n, length), pad_id, np.int32)
        segment_ids = np.zeros((n, length), np.int32)
        mask = np.zeros((n, length), np.float32)
        logp = np.zeros((n, length), np.float32) if rollout_logp is not None else None
        turns = np.full((n, length), -1, np.int32) if turn_ids is not None else None
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            tokens = np.concatenate([np.asarray(prompt, np.int32), np.asarray(completion, np.int32)])
            if len(tokens) > length + 1:
                raise ValueError(
                    f"sequence {i} has {len(tokens)} tokens (prompt {len(prompt)} + completion {len(completion)}) "
                    f"but the packed length allows {length + 1}; raise the length or lower max_new_tokens")
            m = len(tokens) - 1
            input_ids[i, :m], targets[i, :m], segment_ids[i, :m] = tokens[:-1], tokens[1:], 1
            start = len(prompt) - 1
            mask[i, start:m] = 1.0 if model_masks is None else np.asarray(model_masks[i], np.float32)
            if logp is not None:
                logp[i, start:m] = np.asarray(rollout_logp[i], np.float32) * mask[i, start:m]
            if turns is not None:
                turns[i, start:m] = turn_ids[i]
        return cls(
            input_ids=input_ids, positions=np.tile(np.arange(length, dtype=np.int32), (n, 1)),
            segment_ids=segment_ids, targets=targets, mask=mask, generated=mask > 0, rollout_logp=logp,
            prompt_lengths=np.asarray([len(p) for p in prompts], np.int32), turn_ids=turns)

    @classmethod
    def from_samples(cls, pairs: Sequence[tuple[Any, Any]], length: int, pad_id: int, valid: np.ndarray) -> "StepBatch":
        """The batch of a step's ``(example, sample)`` pairs (``example.prompt_ids``,
        ``sample.output_ids``, ``sample.output_logprobs`` and, when the engine returned them, the
        routes ``sample.prompt_routed_experts`` + ``sample.routed_experts``), prompt-major. A
        sample with ``valid`` False (e.g. unparsable) keeps its tokens (the push check and the
        alignment dump read them) but leaves the loss's ``mask``."""
        samples = [s for _, s in pairs]
        if any(s.output_mask is not None for s in samples):  # conversations: the prompt is the environment's
            batch = cls.pack([s.prompt_ids for s in samples], [s.output_ids for s in samples], length, pad_id,
                             rollout_logp=[s.output_logprobs for s in samples],
                             model_masks=[s.output_mask for s in samples],
                             turn_ids=[s.output_turn_ids for s in samples])
        else:
            batch = cls.pack([e.prompt_ids for e, _ in pairs], [s.output_ids for s in samples], length, pad_id,
                             rollout_logp=[s.output_logprobs for s in samples])
        routes = _pack_routes([s for _, s in pairs], batch.segment_ids) if pairs else None
        return batch.replace(mask=batch.mask * np.asarray(valid)[:, None], routed_experts=routes)

    def replace(self, **changes) -> "StepBatch":
        return dataclasses.replace(self, **changes)

    @property
    def rows(self) -> int:
        return int(np.shape(self.input_ids)[0])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) input tokens."""
        return int((np.asarray(self.segment_ids) > 0).sum())

    def model_inputs(self) -> tuple[Any, Any, Any, Any]:
        """``(input_ids, positions, segment_ids, targets)``, the learner's scoring inputs."""
        return self.input_ids, self.positions, self.segment_ids, self.targets

    def prompt_groups(self) -> np.ndarray:
        """[N] int32: one id per distinct prompt (the first ``prompt_lengths`` input tokens), in order of
        first appearance; a GRPO group's samples share theirs (``jaxrl.models.packing.pack_rows``)."""
        ids: dict[bytes, int] = {}
        input_ids, lengths = np.asarray(self.input_ids), np.asarray(self.prompt_lengths)
        keys = (row[:n].tobytes() for row, n in zip(input_ids, lengths, strict=True))
        return np.asarray([ids.setdefault(key, len(ids)) for key in keys], np.int32)

    def mini_batches(self, count: int, aggregation: str, step: int, *, pack: bool = False, micro_batches: int = 1,
                     devices: int = 1, share_prefix: bool = False) -> Iterator["UpdateBatch"]:
        """The ``count`` consecutive row blocks of one step's optimizer updates.

        Each carries the loss's fields only, the normaliser of its own ``mask`` for the
        ``aggregation`` mode (so every micro-batch split of it gives the same loss) and a key
        seed unique to (step, block) for anything the loss draws at random. With ``pack`` the
        model inputs travel as :class:`~jaxrl.models.packing.PackedRows` (several samples per
        row, packed within each of the ``micro_batches`` groups; ``devices``: the data-parallel
        devices the rows spread over), and the samples' own inputs stay behind; with
        ``share_prefix`` too, the samples of one prompt lay it out once (:meth:`prompt_groups`).
        """
        size = self.rows // count
        fields = {name: getattr(self, name) for name in _UPDATE_FIELDS}
        groups = self.prompt_groups() if share_prefix else None
        for s in range(count):
            rows = {name: None if value is None else value[s * size:(s + 1) * size] for name, value in fields.items()}
            tokens, packed = StepBatch(**rows), None
            if pack:
                packed = pack_rows(*tokens.model_inputs(), groups=micro_batches, devices=devices,
                                   routed_experts=tokens.routed_experts,
                                   prefix_groups=None if groups is None else groups[s * size:(s + 1) * size])
                tokens = tokens.replace(input_ids=None, positions=None, segment_ids=None, targets=None,
                                        routed_experts=None)
            normalizer = np.float32(_loss_normalizer(aggregation, tokens.mask))
            yield UpdateBatch(tokens=tokens, normalizer=normalizer, key_seed=np.int32(step * count + s), packed=packed)

    def token_aligned(self, meta: dict) -> AlignmentBatch:
        """The alignment checker's batch of the same sequences: every per-token array moves one
        column right (column t describes token t itself); learner logprobs are ``old_logp``."""
        model_mask = token_aligned(self.generated, False)
        tokens = token_aligned(self.targets)
        tokens[:, 0] = np.asarray(self.input_ids)[:, 0]
        return AlignmentBatch(
            token_ids=tokens, model_mask=model_mask,
            rollout_logprobs=token_aligned(np.asarray(self.rollout_logp, np.float32)),
            learner_logprobs=np.where(model_mask, token_aligned(np.asarray(self.old_logp, np.float32)), 0.0),
            turn_ids=(np.where(model_mask, 0, -1) if self.turn_ids is None else token_aligned(self.turn_ids, -1)),
            prompt_lengths=np.asarray(self.prompt_lengths),
            lengths=np.asarray(self.segment_ids).sum(axis=1) + 1, meta=meta)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UpdateBatch:
    """What one optimizer step sees: a mini-batch of rows, its loss normaliser (0-d float32,
    shared by all its micro-batches), its key seed (0-d int32), with Clip-Cov / KL-Cov over
    several micro-batches the tokens chosen on the whole mini-batch (``cov_selection``) and,
    when packed, the model inputs as packed rows (``packed``; ``tokens`` then holds the
    per-sample loss fields only)."""

    tokens: StepBatch
    normalizer: Any
    key_seed: Any
    cov_selection: Any = None
    packed: PackedRows | None = None

    def replace(self, **changes) -> "UpdateBatch":
        return dataclasses.replace(self, **changes)

    def token_logprobs(self, model, chunk_size: int):
        """The learner's ``(logp, entropy, DecoderOutput)`` of the mini-batch's targets, per sample
        [N, T] float32 whether or not the forward ran on packed rows; the routes it carries (routing
        replay) are replayed."""
        rows = self.tokens if self.packed is None else self.packed
        # Routes only when there are some: a policy without routers need not take the argument.
        replay = {} if rows.routed_experts is None else {"routed_experts": rows.routed_experts}
        logp, entropy, out = model.token_logprobs(*rows.model_inputs(), chunk_size=chunk_size, **replay)
        if self.packed is None:
            return logp, entropy, out
        return self.packed.unpack(logp), self.packed.unpack(entropy), out


def _pack_routes(samples: Sequence[Any], segment_ids: np.ndarray) -> np.ndarray | None:
    """The samples' routes at their input columns [N, T, MoE layers, k] int32 (-1 on padding): a
    sample's ``prompt_routed_experts`` (positions 0 .. P-2) then ``routed_experts`` (P-1 ..
    P+N-2) are exactly its real columns. None when the engine returned no routes."""
    have = [s.routed_experts is not None and s.prompt_routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"sample {have.index(False)} of the step has no routed experts while others have: "
                         "every server of an MoE fleet must return them (return_routed_experts)")
    per_row = [np.concatenate([s.prompt_routed_experts, s.routed_experts]) for s in samples]
    n, length = np.shape(segment_ids)
    routes = np.full((n, length, *per_row[0].shape[1:]), -1, np.int32)
    for i, row in enumerate(per_row):
        columns = int(np.asarray(segment_ids[i]).sum())
        if len(row) != columns or row.shape[1:] != routes.shape[2:]:
            raise ValueError(f"sample {i} has routes {row.shape} for {columns} input positions; an engine returns "
                             f"[prompt + output - 1, MoE layers, k] = ({columns}, *{routes.shape[2:]})")
        routes[i, :columns] = row
    return routes
