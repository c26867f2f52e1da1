"""Stage 8, push: the updated weights go to the rollout engine, and the previous push is verified.

In order, after the update of step k:

1. **verify** the push of version k - 1 on this step's batch, when the engine sampled it with
   those weights and returns raw logprobs (``rollout.verify_push``): the engine's logprobs of
   every generated token against the learner's recompute of them (under bypass, the update's
   first mini-batch measured the gap, ``StepRecord.engine_gap``): their largest |dlogp| when
   both compute in float32, their mean otherwise (``rollout.push_check``), within
   ``rollout.push_tolerance``; a gap above it, or a check of zero tokens, raises
   PushVerificationError. Batches of older weights (``rollout.max_staleness``) are not
   comparable, and under bypass a step in which no policy loss ran (a critic's warm-up) or none
   of the first mini-batch's tokens entered the loss (every sample masked out after its reward,
   e.g. all unparsable) has nothing measured: the next step's batch checks the next push;
2. **drain**: wait for the batches still being generated with the weights about to be replaced
   (the rollout stage's ``drain``);
3. **push** version k (``engine.update_weights``; the engine must then report it);
4. **refill**: start the batches that use the new weights (the rollout stage's ``refill``).

An engine that holds the learner's arrays by reference (the embedded sampler) generating in the
background beside the update gets a copy: the train step donates the arrays it updates.

Metrics: the engine's ``push/*``, ``time/rollout_drain`` and ``time/weight_push``.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

from jaxrl.rollout.base import LogprobKind, PushVerificationError
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.stages.base import PushGap, Stage, StepContext, StepRecord

log = logging.getLogger(__name__)


class Rollouts(Protocol):
    """What the push needs of the rollout stage."""

    background: bool

    def drain(self) -> float: ...

    def refill(self, weights: int, final: bool = False) -> None: ...


class PushStage(Stage):
    name = "push"

    def __init__(self, context: StepContext, rollouts: Rollouts):
        self.context = context
        self.rollouts = rollouts
        self.statistic, self.tolerance, why = push_statistic(context.config.rollout,
                                                             context.learner.model().config.dtype)
        if context.config.rollout.verify_push:
            log.info("push check: %s |dlogp| <= %g nats (%s)", self.statistic, self.tolerance, why)

    def start(self, step: int) -> None:
        """Pushes the learner's weights when the engine does not hold them yet (a resumed run, a
        server with other weights, or a background engine that needs its own copy), then starts
        the first batches."""
        engine = self.context.engine
        if step > 0 or engine.weight_version != "0" or self.copies_weights():
            engine.update_weights(self.engine_weights(), version=str(step))
        self.rollouts.refill(step)

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        self.verify_previous_push(record, step - 1)
        start = time.perf_counter()
        self.rollouts.drain()
        drained = time.perf_counter()
        metrics = self.push(step)
        pushed = time.perf_counter()
        self.rollouts.refill(step, final=step == self.context.config.steps)
        return record, {**metrics, "time/rollout_drain": drained - start, "time/weight_push": pushed - drained}

    def copies_weights(self) -> bool:
        return self.rollouts.background and self.context.engine.holds_references

    def engine_weights(self):
        return self.context.learner.weights(copy=self.copies_weights())

    def push(self, step: int) -> dict[str, float]:
        engine = self.context.engine
        metrics = engine.update_weights(self.engine_weights(), version=str(step)) or {}
        if self.context.config.rollout.verify_push and engine.weight_version != str(step):
            raise PushVerificationError(
                f"pushed weight version {step} but the engine reports {engine.weight_version!r}")
        return metrics

    def verify_previous_push(self, record: StepRecord, learner_version: int) -> None:
        """Step 1 of the module docstring, for the push of ``learner_version``."""
        r = self.context.config.rollout
        if not (r.verify_push and r.logprob_kind == LogprobKind.RAW):
            return
        version = record.oldest_weights
        if version != str(learner_version):  # sampled with older weights (rollout.max_staleness): not comparable
            return
        if self.context.objective.bypass:
            if record.engine_gap is None and np.any(record.batch.generated):  # the loss measured nothing
                return
            # No generated token at all: the zero-token gap, which the check refuses.
            gap = record.engine_gap if record.engine_gap is not None else push_gap(record.batch)
        else:
            gap = push_gap(record.batch)
        check_push(version, gap, self.statistic, tolerance=self.tolerance)


# rollout.push_tolerance's defaults per statistic. float32's gaps are reduction order (under 1e-5
# at their largest); bfloat16's mean gap stayed under 3e-3 where both sides round alike and under
# 0.035 with one side in float32, where a wrong checkpoint's is over 1 nat (bench/bf16_logprob_gap.py).
DEFAULT_TOLERANCE = {"max": 1e-3, "mean": 0.05}


def push_statistic(rollout, learner_dtype: str) -> tuple[str, float, str]:
    """(the statistic of |dlogp| the push check bounds, its tolerance, why): ``rollout.push_check``,
    or for "auto" "max" when the learner (``learner_dtype``, its compute dtype) and the engine
    both compute in float32 and "mean" otherwise; ``rollout.push_tolerance`` or the statistic's
    default. The embedded sampler computes as the learner, launched SGLang servers in
    ``server.dtype``; external servers' dtype is not known, so they get "mean"."""
    if rollout.push_check != "auto":
        statistic, why = rollout.push_check, f"rollout.push_check={rollout.push_check}"
    else:
        if rollout.engine == "embedded":
            engine_dtype = learner_dtype
        elif rollout.sglang.server is not None:
            engine_dtype = rollout.sglang.server.dtype
        else:
            engine_dtype = "unknown (external servers)"
        statistic = "max" if learner_dtype == engine_dtype == "float32" else "mean"
        why = f"rollout.push_check=auto: the learner computes in {learner_dtype}, the engine in {engine_dtype}"
    tolerance = DEFAULT_TOLERANCE[statistic] if rollout.push_tolerance is None else rollout.push_tolerance
    return statistic, tolerance, why


def push_gap(batch: StepBatch) -> PushGap:
    """The gap over every generated token, masked samples included: the spot check of the
    previous weight push needs no reward."""
    gap = np.abs(np.asarray(batch.old_logp) - np.asarray(batch.rollout_logp))[np.asarray(batch.generated)]
    if not gap.size:
        return PushGap(float("nan"), float("nan"), 0)
    return PushGap(float(gap.max()), float(gap.mean()), int(gap.size))


def check_push(version: str, gap: PushGap, statistic: str, *, tolerance: float) -> None:
    """Verifies a weight push: the engine's logprobs of the batch sampled with weights ``version``
    agree with the learner's recompute: ``gap``'s ``statistic`` ("max" or "mean" |dlogp|)
    within ``rollout.push_tolerance``. A check of zero tokens or a NaN fails: it proves nothing.
    Raises PushVerificationError."""
    if gap.tokens == 0:
        raise PushVerificationError(
            f"the push check of weight version {version} compared zero generated tokens, so it proves nothing; "
            f"the engine returned no tokens; set rollout.verify_push=false to run without the check")
    value = gap.largest if statistic == "max" else gap.mean
    if not value <= tolerance:
        measured = f"by up to {value:.3g} nats" if statistic == "max" else f"by {value:.3g} nats on average"
        hint = (" (with bfloat16 on either side, check the mean: rollout.push_check=mean, "
                "docs/rollouts.md#the-push-check-in-bfloat16)") if statistic == "max" else ""
        raise PushVerificationError(
            f"the engine sampled with weight version {version} but its logprobs differ from the learner's "
            f"{measured} (max {gap.largest:.3g}, mean {gap.mean:.3g} over {gap.tokens} tokens) > {tolerance:g} "
            f"(rollout.push_tolerance; rollout.push_check: {statistic}); the engine is not running the "
            f"learner's weights{hint}")
