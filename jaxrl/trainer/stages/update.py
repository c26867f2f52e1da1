"""Stage 7, update: the policy's optimizer steps over mini-batches of the step's fixed batch.

``update.epochs`` passes over ``update.mini_batches`` (S) mini-batches, each one optimizer step
accumulated over ``update.micro_batches`` (``jaxrl.trainer.update``), each drawing from its own
key seed; none when the filter set ``skip_update``. The update guard (``jaxrl.trainer.guard``)
judges every step: non-finite ones are skipped and counted, too many in a row stop the run.

**Co-learners** train beside the policy on the same mini-batches: a model with its own optimizer
(the critic of PPO with GAE, ``jaxrl.trainer.stages.advantage.critic``) is handed to this stage
by ``build_stages`` and provides

- ``update(mini, step) -> metrics``: one step of its own on the mini-batch (host arrays), before
  the policy's;
- ``update_metrics(collected, step, frozen) -> metrics``: its logged metrics of the step, under
  its own prefix, from the metrics its steps returned (none when the step was skipped);
- ``policy_frozen(step) -> bool``: whether the policy sits this step out (a critic's warm-up;
  the learner's schedule does not count those steps, ``Learner.frozen_steps``).

The policy's loss reads no co-learner field (``values``, ``returns``), so they leave its batch.

Metrics: the train step's and the loss's ``update/*`` averaged over the S mini-batches (the
loss's ``mismatch/*`` under bypass: the first mini-batch's, before any update), with packing
``update/padding_fraction{,_unpacked}`` and ``update/shared_prefix_fraction``, the guard's
counts, ``update/lr`` and ``update/skipped_total``; and each co-learner's.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import jax
import numpy as np

from jaxrl.models.sharding import batch_devices, batch_shardings
from jaxrl.trainer.batch import StepBatch, UpdateBatch
from jaxrl.trainer.guard import UpdateGuard
from jaxrl.trainer.stages.base import PushGap, Stage, StepContext, StepRecord
from jaxrl.trainer.update import update_names


class CoLearner(Protocol):
    def update(self, mini: UpdateBatch, step: int) -> dict[str, Any]: ...

    def update_metrics(self, collected: list[dict], step: int, frozen: bool) -> dict[str, float]: ...

    def policy_frozen(self, step: int) -> bool: ...


class UpdateStage(Stage):
    name = "update"

    def __init__(self, context: StepContext, co_learners: Sequence[CoLearner] = ()):
        self.context = context
        u = context.config.update
        self.co_learners = tuple(co_learners)
        self.guard = UpdateGuard(u.max_consecutive_skips, u.spike_factor, context.warn)
        self.skipped_updates = 0

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        metrics = self.update(record.batch, step, record.skip_update)
        gap = None
        # Only a policy loss with tokens measured anything: a step whose every sample was masked out
        # after its reward (unparsable) has none in the loss, though the engine generated some.
        if self.context.objective.bypass and metrics.get("mismatch/num_tokens", 0) > 0:
            gap = PushGap(float(metrics.get("mismatch/abs_log_ratio_max", np.nan)),
                          float(metrics.get("mismatch/abs_log_ratio_mean", np.nan)),
                          int(metrics["mismatch/num_tokens"]))
        return record.replace(engine_gap=gap), metrics

    def update(self, batch: StepBatch, step: int, skip: bool) -> dict[str, float]:
        """S optimizer steps over mini-batches of the fixed batch (each micro-batch-accumulated),
        none when the filter said ``skip``; the co-learners' on the same mini-batches."""
        c, u = self.context, self.context.config.update
        learner = c.learner
        collected, padding, cells = [], [], []
        co_collected: list[list[dict]] = [[] for _ in self.co_learners]
        frozen = any(co.policy_frozen(step) for co in self.co_learners)
        # E passes of the S mini-batches (update.epochs); each update draws from its own key seed.
        minis = (mini for epoch in range(u.epochs) for mini in batch.mini_batches(
            u.mini_batches, c.objective.aggregation, step * u.epochs + epoch, pack=u.pack,
            micro_batches=u.micro_batches, devices=batch_devices(c.mesh), share_prefix=u.share_prefix))
        for mini in minis if not skip else ():
            if mini.packed is not None:
                padding.append(mini.packed.padding_fraction)
                cells.append(mini.packed.real_cells)
            for co, out in zip(self.co_learners, co_collected, strict=True):
                out.append(co.update(mini, step))
            if frozen:
                continue
            mini = mini.replace(tokens=mini.tokens.replace(values=None, returns=None))
            # Placed on the mesh here: jit refuses numpy inputs for arrays spread over processes.
            mini = jax.device_put(mini, batch_shardings(mini, c.mesh))
            learner.state, metrics = learner.train_step(learner.state, mini)
            collected.append(jax.device_get(metrics))
            self.guard.check(step, collected[-1])
        self.skipped_updates += int(skip)
        # Mismatch metrics measured in the loss (bypass) are valid on the first mini-batch only,
        # before any update; everything else is averaged over the S mini-batches.
        averaged = {k: collected[0][k] if k.startswith("mismatch_") else np.mean([m[k] for m in collected])
                    for k in (collected[0] if collected else ())}
        if padding:  # what packing saved: the padding of the rows the learner ran, unpacked and packed
            averaged["padding_fraction"] = float(np.mean(padding))
            averaged["padding_fraction_unpacked"] = 1.0 - batch.num_tokens / np.size(batch.segment_ids)
        if cells and u.share_prefix:  # the tokens the learner did not run again: prompts laid out once
            averaged["shared_prefix_fraction"] = 1.0 - sum(cells) / (u.epochs * batch.num_tokens)
        co_metrics = {k: v for co, out in zip(self.co_learners, co_collected, strict=True)
                      for k, v in co.update_metrics(out, step, frozen).items()}
        policy_update = max((step - learner.frozen_steps) * u.mini_batches * u.epochs - 1, 0)
        return {**update_names(averaged), **self.guard.metrics(), **co_metrics,
                "update/lr": float(learner.schedule(policy_update)), "update/skipped_total": self.skipped_updates}

    def checkpoint(self, step: int) -> dict:
        return {"skipped_updates": self.skipped_updates, "guard": self.guard.state()}

    def restore(self, meta: dict, items: dict) -> None:
        self.skipped_updates = int(meta["skipped_updates"])
        if "guard" in meta:  # absent in checkpoints written before the update guard existed
            self.guard.restore(meta["guard"])
