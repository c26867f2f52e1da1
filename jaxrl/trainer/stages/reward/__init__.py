"""Stage 2, reward: the per-task reward functions score the step's samples.

The reward router (``jaxrl.reward``, with the judges of ``jaxrl.trainer.judges``) scores the
text of each sample's model tokens; a conversation's environment reward, when it gives one, is
added to its task's score. Unparsable samples, and samples whose reward function raised, leave
the gradient and their group's baseline when ``reward.mask_unparsable`` (Motif): the record's
``valid``. ReMax's greedy responses are scored the same way (``greedy_scores``).

With ``rollout.dynamic_sampling`` (DAPO) this stage also keeps only the groups whose rewards vary,
drawing more prompts until the batch is full (:mod:`~jaxrl.trainer.stages.reward.dynamic_sampling`;
the extra draws come from the rollout stage through the ``draw`` it is given): the filter needs
the rewards, so it lives where they are made. Its metrics keep the ``rollout/dynamic_sampling_*``
names, and ``time/dynamic_sampling`` times it.

Metrics: ``reward/{mean,std,accuracy,unparsable_fraction,raised,timed_out}`` of the batch the
step trains on, per task ``reward/<task>/{mean,std,share}``, the judges' ``reward/judge/*`` and the
code tests' ``reward/code/*`` (``jaxrl.reward.code_batch``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from jaxrl.reward.base import ScoredBatch
from jaxrl.rollout.base import Sample
from jaxrl.trainer.stages.base import Stage, StepContext, StepRecord
from jaxrl.trainer.stages.reward.dynamic_sampling import fill_with_signal


class RewardStage(Stage):
    """Scores the record's samples; ``draw(step, j)``: the j-th extra draw of new prompts (the
    rollout stage's), for dynamic sampling."""

    name = "reward"

    def __init__(self, context: StepContext, draw: Callable[[int, int], StepRecord]):
        self.context = context
        self.draw = draw

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        record = self.score(record)
        metrics: dict[str, float] = {}
        r = self.context.config.rollout
        if r.dynamic_sampling:  # more prompts, same weights, until every group has reward variance
            start = time.perf_counter()
            record, metrics = fill_with_signal(record, lambda j: self.score(self.draw(step, j)),
                                               prompts=r.prompts_per_step, group_size=r.group_size,
                                               max_extra_draws=r.max_extra_draws)
            metrics["time/dynamic_sampling"] = time.perf_counter() - start
        return record, {**reward_metrics(record.scored, self.context.router.take_metrics()), **metrics}

    def score(self, record: StepRecord) -> StepRecord:
        """The record with its samples' ``scored``, ``valid`` and (with greedy samples) ``greedy_scores``."""
        scored = self._score(record.examples, record.samples)
        greedy = None if record.greedy is None else self._score(record.examples, record.greedy).scores
        valid = ~scored.unparsable if self.context.config.reward.mask_unparsable else np.ones(len(scored.scores), bool)
        return record.replace(scored=scored, greedy_scores=greedy, valid=valid)

    def _score(self, examples, samples) -> ScoredBatch:
        """The task rewards of the model's tokens (and an environment's own reward)."""
        c = self.context
        flat = [(e, s) for e, group in zip(examples, samples, strict=True) for s in group]
        responses = [c.tokenizer.decode(s.model_ids, skip_special_tokens=True) for _, s in flat]
        scored = c.router.score([e.prompt for e, _ in flat], responses, [s.model_ids.tolist() for _, s in flat],
                                [e.row for e, _ in flat], on_error=c.on_error)
        return with_environment_rewards(scored, [s for _, s in flat])


def with_environment_rewards(scored: ScoredBatch, samples: Sequence[Sample]) -> ScoredBatch:
    """The task's scores plus each conversation's environment reward (where it gave one)."""
    rewards = np.asarray([0.0 if s.episode is None or s.episode.reward is None else float(s.episode.reward)
                          for s in samples], np.float32)
    if not rewards.any():
        return scored
    return dataclasses.replace(scored, scores=(np.asarray(scored.scores, np.float32) + rewards))


def reward_metrics(scored: ScoredBatch, scorers: dict[str, float] | None = None) -> dict[str, float]:
    """The batch's reward statistics, with the router's ``judge/*`` and ``code/*`` metrics
    (``RewardRouter.take_metrics``) as ``reward/judge/*`` and ``reward/code/*``."""
    metrics = {
        "reward/mean": float(scored.scores.mean()),
        "reward/std": float(scored.scores.std()),
        "reward/accuracy": float((scored.scores >= 1.0).mean()),
        "reward/unparsable_fraction": float(scored.unparsable.mean()),
        "reward/raised": float(scored.raised.sum()),
        "reward/timed_out": float(scored.timed_out.sum()),
    }
    tasks = np.asarray(scored.tasks)
    for task in sorted(set(scored.tasks)):
        values = scored.scores[tasks == task]
        metrics[f"reward/{task}/mean"] = float(values.mean())
        metrics[f"reward/{task}/std"] = float(values.std())
        metrics[f"reward/{task}/share"] = float(len(values) / len(tasks))  # of the batch (data.mixture)
    metrics.update({f"reward/{name}": value for name, value in (scorers or {}).items()})
    return metrics
