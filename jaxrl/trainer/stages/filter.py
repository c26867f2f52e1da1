"""Stage 6, filter: skip the step's update when the engine and the learner disagree too much on its batch.

With ``objective.batch_filter_threshold`` set, the batch's ``objective.batch_filter_metric`` of
the learner's ``old_logp`` against the engine's logprobs (docs/losses.md#batch-filter) above the
threshold sets the record's ``skip_update``: the update stage then changes no learner state (nor
a co-learner's). Never under bypass, which has no recompute to compare with.

Metrics: ``filter/skip`` and ``filter/value`` (the measured metric), when the filter is on.
"""

from __future__ import annotations

import jax

from jaxrl.losses import ObjectiveConfig, batch_filter
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.stages.base import Stage, StepContext, StepRecord


class FilterStage(Stage):
    name = "filter"

    def __init__(self, context: StepContext):
        self.objective = context.objective

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        skip, metrics = batch_filter_stage(record.batch, self.objective)
        return record.replace(skip_update=skip), metrics


def batch_filter_stage(batch: StepBatch, objective: ObjectiveConfig) -> tuple[bool, dict[str, float]]:
    """Whether to skip the step's update because the engine and the learner disagree too much
    on this batch (``objective.batch_filter_threshold``; never under bypass, which has no recompute)."""
    if objective.batch_filter_threshold is None or objective.bypass:
        return False, {}
    skip, metrics = jax.device_get(_batch_filter(
        batch.old_logp, batch.rollout_logp, batch.mask,
        threshold=objective.batch_filter_threshold, metric=objective.batch_filter_metric))
    return bool(skip), {f"filter/{k.removeprefix('batch_filter_')}": float(v) for k, v in metrics.items()}


_batch_filter = jax.jit(batch_filter, static_argnames=("threshold", "metric"))
