"""Partial rollouts (``rollout.partial_tokens``): long generations spread over several steps.

slime's ``--partial-rollout``, in the trainer's rollout stage (``jaxrl.trainer.stages.rollout``;
docs/training.md#partial-rollouts).
A pool holds the prompt groups in flight. A step runs rounds with the engine's current weights:
the pool is topped up with new prompts so that started plus finished (not yet trained) groups
make ``partial_groups`` (>= ``prompts_per_step``: the over-sampling that lets a step end when
its fastest groups finish), then every unfinished sample generates at most ``partial_tokens`` more
tokens (new groups from their prompt, ``group_size`` samples each; started ones from their
prompt and their tokens so far). A sample is finished at a stop token or at ``max_new_tokens``
in all; a group when all its samples are. Rounds repeat until ``prompts_per_step`` groups are
finished, and the step trains on those, in the order they finished. The groups still in flight
stay in the pool and go on in the next step with the new weights: their samples then hold
tokens of several versions, recorded per token (``Sample.output_versions``; ``weight_version``
is the oldest). The engine's logprob of each token is the policy that sampled it, so the
mismatch corrections use the right behaviour policy, and the learner recomputes ``old_logp``
as always. Routes (MoE) of earlier tokens are kept as they were generated.

With ``partial_tokens >= max_new_tokens`` and ``partial_groups = prompts_per_step`` every group
finishes in its first round and the step is the synchronous loop's, sample for sample: the
first round of step k draws the same prompts and samples with the same seed.

Exact resume: the checkpoint records, for every prompt drawn and not yet trained on, the data
iterator's state before the draw that yielded it and its place in that draw, and the samples it
has so far; resume draws those prompts again and puts the samples back.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from jaxrl.rollout.base import Sample
from jaxrl.trainer.stages.rollout.queue import RolloutBatch
from jaxrl.trainer.stages.rollout.records import decode_groups, encode_groups

# Seed draws per round: one for the new groups, one per distinct continuation budget (at most two:
# partial_tokens, and what max_new_tokens leaves).
DRAWS_PER_ROUND = 4
# (prompts, samples per prompt, max new tokens, seed) -> samples [prompt][sample], with the engine's weights.
GenerateFn = Callable[[list[list[int]], int, int, int], list[list[Sample]]]


@dataclasses.dataclass(eq=False)  # groups are compared by identity
class Group:
    """One prompt in flight: the example, where it was drawn (draw id, place in that draw) and
    its samples so far (None before its first round)."""

    example: Any
    origin: tuple[int, int]
    samples: list[Sample] | None = None


class PartialRolloutQueue:
    """The rollout stage with partial rollouts; the interface of ``RolloutQueue``.

    iterator: the run's prompt iterator; generate: see ``GenerateFn``; seed(step, draw): the
    sampling seed of a step's ``draw``-th engine call (draw 0 is the synchronous loop's)."""

    background = False

    def __init__(self, iterator, generate: GenerateFn, seed: Callable[[int, int], int], *, prompts: int,
                 groups: int, group_size: int, partial_tokens: int, max_new_tokens: int):
        self.iterator, self.generate, self.seed = iterator, generate, seed
        self.prompts, self.groups, self.group_size = prompts, groups, group_size
        self.partial_tokens, self.max_new_tokens = partial_tokens, max_new_tokens
        self.version = 0
        self.draws: dict[int, Any] = {}  # draw id -> the iterator's state before that draw
        self.waiting: list[Group] = []  # drawn, not started
        self.pool: list[Group] = []  # started, unfinished
        self.finished: list[Group] = []  # finished, not yet trained on

    # ---------------------------------------------------------------- the loop
    def fill(self, weights: int, final: bool = False) -> None:
        """The engine now holds the learner's version ``weights``."""
        self.version = weights

    def take(self, index: int) -> RolloutBatch:
        """Step ``index``'s groups: rounds until ``prompts`` groups are finished (module doc)."""
        start, rounds, carried_in = time.perf_counter(), 0, len(self.pool)
        while len(self.finished) < self.prompts:
            self._top_up()
            self._round(index, rounds)
            rounds += 1
        chosen, self.finished = self.finished[:self.prompts], self.finished[self.prompts:]
        live = {g.origin[0] for g in self.waiting + self.pool + self.finished}
        self.draws = {d: s for d, s in self.draws.items() if d in live}
        samples = [g.samples for g in chosen]
        flat = [s for group in samples for s in group]
        lags = np.concatenate([index - 1 - s.output_versions for s in flat])
        batch = RolloutBatch(index, [g.example for g in chosen], self.version, None, samples,
                             generate_seconds=time.perf_counter() - start)
        batch.metrics = {
            "rollout/partial_rounds": float(rounds), "rollout/partial_carried_in": float(carried_in),
            "rollout/partial_in_flight": float(len(self.pool)),
            "rollout/partial_samples": float(np.mean([len(set(s.output_versions.tolist())) > 1 for s in flat])),
            "rollout/token_staleness_mean": float(lags.mean()), "rollout/token_staleness_max": float(lags.max()),
        }
        return batch

    def before_push(self) -> float:
        return 0.0  # nothing runs in the background

    def close(self) -> None:
        return None

    # ---------------------------------------------------------------- rounds
    def _top_up(self) -> None:
        while len(self.pool) + len(self.finished) < self.groups:
            if not self.waiting:
                draw = max(self.draws, default=-1) + 1
                self.draws[draw] = self.iterator.state()
                self.waiting = [Group(e, (draw, k)) for k, e in enumerate(next(self.iterator))]
            self.pool.append(self.waiting.pop(0))

    def _round(self, index: int, round_: int) -> None:
        """Every unfinished sample of the pool generates up to ``partial_tokens`` more tokens."""
        new = [g for g in self.pool if g.samples is None]
        if new:
            budget = min(self.partial_tokens, self.max_new_tokens)
            prompts = [g.example.prompt_ids.tolist() for g in new]
            # Round 0's draw is the synchronous loop's (seed draw 0); later rounds and the
            # continuations take draws of their own.
            drawn = self.generate(prompts, self.group_size, budget, self.seed(index, round_ * DRAWS_PER_ROUND))
            for group, samples in zip(new, drawn, strict=True):
                group.samples = [dataclasses.replace(s, output_versions=np.full(len(s.output_ids), self.version,
                                                                                 np.int32)) for s in samples]
        going = [(g, j) for g in self.pool if g not in new for j, s in enumerate(g.samples)
                 if not self._done(s)]
        by_budget: dict[int, list[tuple[Group, int]]] = {}
        for g, j in going:
            left = self.max_new_tokens - len(g.samples[j].output_ids)
            by_budget.setdefault(min(self.partial_tokens, left), []).append((g, j))
        for n, (budget, members) in enumerate(sorted(by_budget.items())):
            prompts = [np.concatenate([g.example.prompt_ids, g.samples[j].output_ids]).tolist() for g, j in members]
            more = self.generate(prompts, 1, budget, self.seed(index, round_ * DRAWS_PER_ROUND + 1 + n))
            for (g, j), (extra,) in zip(members, more, strict=True):
                g.samples[j] = self._extend(g.samples[j], extra)
        done = [g for g in self.pool if all(self._done(s) for s in g.samples)]
        self.finished += done
        self.pool = [g for g in self.pool if g not in done]

    def _done(self, sample: Sample) -> bool:
        return sample.finish_reason == "stop" or len(sample.output_ids) >= self.max_new_tokens

    def _extend(self, sample: Sample, more: Sample) -> Sample:
        """``sample`` continued by ``more`` (generated from its prompt and output so far)."""
        routes = None
        if sample.routed_experts is not None and more.routed_experts is not None:
            # more.routed_experts[0] routes the position of sample's last token: the next row.
            routes = np.concatenate([sample.routed_experts, more.routed_experts])
        return dataclasses.replace(
            sample, output_ids=np.concatenate([sample.output_ids, more.output_ids]),
            output_logprobs=np.concatenate([sample.output_logprobs, more.output_logprobs]),
            finish_reason=more.finish_reason, routed_experts=routes,
            output_versions=np.concatenate([sample.output_versions,
                                            np.full(len(more.output_ids), self.version, np.int32)]))

    # ---------------------------------------------------------------- checkpoints
    def state(self, learner_version: int) -> dict[str, Any]:
        """The checkpoint record: the iterator now, and every drawn group not yet trained on."""
        groups = {"waiting": self.waiting, "pool": self.pool, "finished": self.finished}
        used = {g.origin[0] for gs in groups.values() for g in gs}
        return {"data": self.iterator.state(), "pending": [], "partial": {
            "draws": {str(d): self.draws[d] for d in sorted(used)},
            **{name: [{"origin": list(g.origin), "samples": None if g.samples is None else encode_groups([g.samples])}
                      for g in gs] for name, gs in groups.items()}}}

    def restore(self, record: dict[str, Any]) -> None:
        """Puts back :meth:`state`'s record (a checkpoint without one: the iterator only)."""
        partial = record.get("partial")
        if partial is not None:
            drawn = {}
            for draw, state in partial["draws"].items():
                self.iterator.restore(state)
                drawn[int(draw)] = next(self.iterator)
            self.draws = {int(d): s for d, s in partial["draws"].items()}

            def group(saved):
                draw, k = saved["origin"]
                example = drawn[draw][k]
                samples = None if saved["samples"] is None else decode_groups(saved["samples"], [example])[0]
                return Group(example, (draw, k), samples)

            self.waiting, self.pool, self.finished = ([group(g) for g in partial[name]]
                                                      for name in ("waiting", "pool", "finished"))
        self.iterator.restore(record["data"])


__all__ = ["PartialRolloutQueue"]
