"""Dynamic sampling (DAPO, Yu et al., 2025, section 3.2): a step's batch holds only prompt groups
whose rewards vary.

A group whose samples all got the same reward (all right, all wrong) has GRPO advantage 0 for
every sample: it adds tokens to the loss's normaliser and no gradient, so as the policy gets
better at the easy prompts and stays hopeless at the hard ones the effective batch shrinks.
With ``rollout.dynamic_sampling`` the trainer drops those groups and draws more prompts (with
the same weights) until the batch holds ``prompts_per_step`` groups with signal, at most
``rollout.max_extra_draws`` extra draws of ``prompts_per_step`` prompts each. If the cap is
reached first, the remaining places are filled with dropped groups (the earliest first) so the
batch keeps its shape, and ``rollout/dynamic_sampling_short`` counts them.

Metrics (``rollout/``): ``dynamic_sampling_draws`` (extra draws this step),
``dynamic_sampling_dropped`` (zero-variance groups left out of the batch) and the same per task
``dynamic_sampling_dropped/<task>``, ``dynamic_sampling_short``. Groups with signal drawn beyond
the batch's ``prompts_per_step`` are left out too (not counted as drops): DAPO's over-sampling.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxrl.reward.base import ScoredBatch
from jaxrl.trainer.stages.base import StepRecord


def groups_with_signal(scored: ScoredBatch, valid: np.ndarray, group_size: int) -> np.ndarray:
    """[P] bool: whether group p's valid samples (those that enter the loss and the baseline)
    got at least two different rewards, i.e. its GRPO advantages are not all zero."""
    scores = np.asarray(scored.scores).reshape(-1, group_size)
    live = np.asarray(valid, bool).reshape(-1, group_size)
    top = np.where(live, scores, -np.inf).max(axis=1)
    bottom = np.where(live, scores, np.inf).min(axis=1)
    return live.any(axis=1) & (top > bottom)


def _take(drawn: StepRecord, groups: list[int], group_size: int) -> StepRecord:
    rows = np.asarray([g * group_size + j for g in groups for j in range(group_size)], int)
    s = drawn.scored
    scored = ScoredBatch(
        scores=s.scores[rows], unparsable=s.unparsable[rows], raised=s.raised[rows],
        tasks=tuple(s.tasks[r] for r in rows), timed_out=s.timed_out[rows],
        token_rewards=tuple(s.token_rewards[r] for r in rows))
    greedy = None if drawn.greedy_scores is None else np.asarray(drawn.greedy_scores)[groups]
    return StepRecord(examples=[drawn.examples[g] for g in groups], samples=[drawn.samples[g] for g in groups],
                      scored=scored, greedy_scores=greedy, valid=np.asarray(drawn.valid)[rows])


def _concat(parts: list[StepRecord]) -> StepRecord:
    scored = [p.scored for p in parts]
    greedy = None if parts[0].greedy_scores is None else np.concatenate([p.greedy_scores for p in parts])
    return StepRecord(
        examples=[e for p in parts for e in p.examples], samples=[g for p in parts for g in p.samples],
        scored=ScoredBatch(scores=np.concatenate([s.scores for s in scored]),
                           unparsable=np.concatenate([s.unparsable for s in scored]),
                           raised=np.concatenate([s.raised for s in scored]),
                           tasks=tuple(t for s in scored for t in s.tasks),
                           timed_out=np.concatenate([s.timed_out for s in scored]),
                           token_rewards=tuple(t for s in scored for t in s.token_rewards)),
        greedy_scores=greedy, valid=np.concatenate([p.valid for p in parts]))


def fill_with_signal(first: StepRecord, draw: Callable[[int], StepRecord], *, prompts: int, group_size: int,
                     max_extra_draws: int) -> tuple[StepRecord, dict[str, float]]:
    """The step's ``prompts`` groups with reward variance, from the scored record ``first`` and up
    to ``max_extra_draws`` calls ``draw(j)`` (j = 1, 2, ...: the j-th extra draw, scored); a
    record's ``valid`` gives the samples that count (as in the loss). Returns the batch's record
    (examples, samples, scores, greedy scores and validity) and its ``rollout/`` metrics."""
    kept, zero_variance = [], []
    draws, drawn = 0, first
    while True:
        signal = groups_with_signal(drawn.scored, drawn.valid, group_size)
        for g, has_signal in enumerate(signal):
            (kept if has_signal else zero_variance).append(_take(drawn, [g], group_size))
        if len(kept) >= prompts or draws >= max_extra_draws:
            break
        draws += 1
        drawn = draw(draws)
    short = max(prompts - len(kept), 0)
    batch = _concat(kept[:prompts] + zero_variance[:short])
    dropped_by_task = {group.scored.tasks[0]: 0 for group in kept + zero_variance}  # every task drawn
    for group in zero_variance[short:]:
        dropped_by_task[group.scored.tasks[0]] = dropped_by_task.get(group.scored.tasks[0], 0) + 1
    metrics = {"rollout/dynamic_sampling_draws": float(draws),
               "rollout/dynamic_sampling_dropped": float(len(zero_variance) - short),
               "rollout/dynamic_sampling_short": float(short)}
    metrics.update({f"rollout/dynamic_sampling_dropped/{task}": float(n)
                    for task, n in sorted(dropped_by_task.items())})
    return batch, metrics
