"""Stage 4, recompute: the learner's ``old_logp`` and the frozen reference's ``ref_logp`` of the batch.

The learner scores the engine's tokens with the parameters that sampled them (the same version,
or newer with ``rollout.max_staleness``): ``old_logp``, the ratio's denominator. With
``objective.bypass`` (or ``update.recompute_old_logp: when_needed`` where it is redundant:
:func:`objective_for_run`) the engine's own logprobs stand in and no forward runs here; the
mismatch is then measured on the update's first mini-batch. The frozen reference scores the
batch when the objective's KL (or ``update.reference_metrics``) needs it. With
``update.routing_replay`` both forwards replay the engine's routes; without it the routes are
only measured and then dropped from the batch. Every ``logging.dump_batch_every`` steps the batch
is written in the alignment checker's format (``jaxrl align report`` reads it).

Metrics: ``recompute/entropy``, ``mismatch/*`` (and ``mismatch_bucket/*``, ``mismatch_turn/*`` for
conversations), ``routing/disagreement*`` for an MoE engine's routes; ``time/recompute`` is not
logged when no forward runs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import distributed
from jaxrl.losses import ObjectiveConfig, mismatch_metrics, mismatch_metrics_by_rollout_prob, mismatch_metrics_by_turn
from jaxrl.models.scoring import LogprobScorer
from jaxrl.models.sharding import batch_devices
from jaxrl.rollout.base import LogprobKind
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.stages.base import Stage, StepContext, StepRecord


class RecomputeStage(Stage):
    name = "recompute"

    def __init__(self, context: StepContext):
        self.context = context
        config, learner = context.config, context.learner
        u = config.update
        sequences = config.rollout.prompts_per_step * config.rollout.group_size
        rows = sequences // (u.mini_batches * u.micro_batches)
        self.scorer = LogprobScorer(learner.train_step.graphdef, context.mesh, rows, u.logprob_chunk_size,
                                    pack=u.pack, devices=batch_devices(context.mesh))
        # Bypass without a KL reference runs no learner forward here, so there is nothing to time.
        self.timed = not context.objective.bypass or learner.reference is not None

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        c, u = self.context, self.context.config.update
        batch, metrics = recompute(record.batch, self.scorer, c.learner.state["params"], c.learner.reference,
                                   bypass=c.objective.bypass, replay=u.routing_replay,
                                   moe_layers=c.learner.moe_layers, share_prefix=u.share_prefix)
        if not u.routing_replay:  # measured; the update routes by itself
            batch = batch.replace(routed_experts=None)
        self._dump(step, batch)
        return record.replace(batch=batch), metrics

    def _dump(self, step: int, batch: StepBatch) -> None:
        """Every ``logging.dump_batch_every`` steps, the batch in the alignment checker's format;
        learner logprobs are ``old_logp``."""
        config = self.context.config
        every = config.logging.dump_batch_every
        if every and step % every == 0 and distributed.is_main_process():
            path = os.path.join(config.output_dir, "batches", f"step-{step:06d}.npz")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            meta = {"step": step, "weight_version": self.context.engine.weight_version, "source": "jaxrl train"}
            batch.token_aligned(meta).save(path)


def objective_for_run(config: TrainConfig, builds_engine: bool,
                      has_experts: bool) -> tuple[ObjectiveConfig, str]:
    """The objective the run trains with, and why (a line for the log). ``has_experts``: the model
    has MoE layers (``jaxrl.trainer.model.has_experts``).

    With ``update.recompute_old_logp: when_needed`` the learner's recompute of ``old_logp`` is
    skipped, through the bypass path (the engine's logprobs as ``old_logp``, the mismatch
    measured on the update's first mini-batch), when it is redundant: the trainer's own embedded
    sampler generates from the learner's parameter arrays, so its raw logprobs are the learner's
    up to the float32 residual of decoding (jaxrl.rollout.sampler), and a single mini-batch
    means the update's first forward is that same policy. Anything that reads the
    learner-versus-engine ratio (a mismatch correction or rejection, the batch filter) needs the
    recompute and keeps it. So do two runs whose recompute is also a check: an MoE model (the
    learner's own routes against the engine's, ``routing/disagreement``: a near-tie in a router's
    top-k flips an expert and the logprob with it, so the engine's are not the learner's up to a
    residual) and conversations (the first model turn against the later ones, generated after
    tool output was spliced in, ``mismatch_turn/*``).
    """
    objective, u = config.objective, config.update
    if u.recompute_old_logp == "always" or objective.bypass:
        return objective, "the learner recomputes old_logp" if not objective.bypass else "objective.bypass"
    blockers = [why for failed, why in (
        (not builds_engine or config.rollout.engine != "embedded", "the engine is not the trainer's embedded sampler"),
        (config.rollout.logprob_kind != LogprobKind.RAW, "rollout.logprob_kind is not raw"),
        (u.mini_batches != 1, f"update.mini_batches={u.mini_batches} (later mini-batches are off-policy)"),
        (config.rollout.max_staleness > 0, f"rollout.max_staleness={config.rollout.max_staleness} (samples come "
                                           "from older weights)"),
        (config.rollout.partial_tokens > 0, f"rollout.partial_tokens={config.rollout.partial_tokens} (carried "
                                            "samples hold tokens of older weights)"),
        (has_experts, "the model has MoE layers (routing/disagreement compares the learner's "
                                     "routes with the engine's)"),
        (config.env is not None, "env: conversations (mismatch_turn/* compares the later turns with the first)"),
        (config.logging.dump_batch_every > 0, f"logging.dump_batch_every={config.logging.dump_batch_every} (the "
                                              "dumped batches hold the learner's recompute for the alignment checker)"),
    ) if failed]
    try:
        fast = dataclasses.replace(objective, bypass=True)
    except ValueError:
        blockers.append("the objective reads the learner-versus-engine ratio (a mismatch correction, rejection "
                        "or the batch filter)")
    if blockers:
        return objective, "update.recompute_old_logp=when_needed keeps the recompute: " + "; ".join(blockers)
    return fast, "update.recompute_old_logp=when_needed: old_logp is the embedded sampler's own (no recompute)"


def recompute(batch: StepBatch, scorer: LogprobScorer, params, reference, *, bypass: bool, replay: bool = False,
              moe_layers: tuple[int, ...] = (), share_prefix: bool = False) -> tuple[StepBatch, dict[str, float]]:
    """``old_logp`` from the learner (or the engine's own under ``bypass``) and ``ref_logp``
    from the frozen ``reference`` parameters (when not None); with ``replay`` both forwards use
    the batch's routes (routing replay); with ``share_prefix`` a packing scorer lays each prompt
    out once (``StepBatch.prompt_groups``).

    Metrics: ``recompute/entropy``, the policy's token entropy on the whole batch before the
    update, and the mismatch between the recompute and the engine's logprobs, all from one
    jitted program and one transfer to the host; when the batch has the engine's routes,
    ``routing/disagreement`` and per MoE layer ``routing/disagreement_layer<i>`` (model layer i):
    the fraction of positions whose learner top-k differs from the engine's, replayed or not;
    for conversations ``mismatch_turn/{first_turn,later_turns}_<stat>``.
    """
    metrics: dict[str, float] = {}
    routes = batch.routed_experts
    shared = {"prefix_groups": batch.prompt_groups()} if share_prefix else {}
    if bypass:
        batch = batch.replace(old_logp=batch.rollout_logp)
    else:
        scores = scorer.score(params, *batch.model_inputs(), routed_experts=routes, replay=replay, **shared)
        batch = batch.replace(old_logp=scores.logp)
        statistics = jax.device_get(_recompute_statistics(scores.logp, batch.rollout_logp, batch.mask, scores.entropy))
        metrics["recompute/entropy"] = float(statistics.pop("entropy"))
        metrics.update(mismatch_names(statistics.pop("mismatch")))
        metrics.update(_bucketed(statistics.pop("buckets")))
        metrics.update(routing_names(scores.route_disagreement, moe_layers))
        if batch.turn_ids is not None:  # conversations: the first model turn against the later ones
            by_turn = jax.device_get(_mismatch_by_turn(scores.logp, batch.rollout_logp, batch.mask, batch.turn_ids))
            metrics.update({f"mismatch_turn/{k}": float(v) for k, v in by_turn.items()})
    if reference is not None:
        reference_routes = routes if replay else None
        batch = batch.replace(ref_logp=scorer.score(reference, *batch.model_inputs(), routed_experts=reference_routes,
                                                    replay=replay, **shared).logp)
    return batch, metrics


def routing_names(disagreement: np.ndarray | None, moe_layers: tuple[int, ...]) -> dict[str, float]:
    """Per MoE layer route disagreement [L] -> ``routing/disagreement`` (the mean over layers) and
    ``routing/disagreement_layer<i>`` named by model layer index (none without routes)."""
    if disagreement is None:
        return {}
    metrics = {"routing/disagreement": float(np.mean(disagreement))}
    metrics.update({f"routing/disagreement_layer{layer}": float(value)
                    for layer, value in zip(moe_layers, disagreement, strict=True)})
    return metrics


@jax.jit
def _recompute_statistics(old_logp, rollout_logp, mask, entropy) -> dict[str, Any]:
    """The masked mean entropy, ``mismatch/*`` over the masked tokens and the same per
    rollout-probability bucket (docs/losses.md#mismatch-metrics: the mismatch concentrates on
    low-probability tokens), in one program."""
    weights = jnp.asarray(mask, jnp.float32)
    return {"entropy": jnp.sum(entropy * weights) / jnp.maximum(jnp.sum(weights), 1.0),
            "mismatch": mismatch_metrics(old_logp, rollout_logp, mask),
            "buckets": mismatch_metrics_by_rollout_prob(old_logp, rollout_logp, mask)}


def mismatch_names(metrics: dict) -> dict[str, float]:
    """The loss library's ``mismatch_<stat>`` -> the logged ``mismatch/<stat>``."""
    return {f"mismatch/{k.removeprefix('mismatch_')}": float(v) for k, v in metrics.items()}


_mismatch_by_turn = jax.jit(mismatch_metrics_by_turn)


def _bucketed(metrics: dict) -> dict[str, float]:
    """Per rollout-probability bucket mismatch stats as scalars ``mismatch_bucket/<stat>/<lo>-<hi>``,
    for the buckets that hold tokens."""
    edges = np.asarray(metrics.pop("mismatch_bucket_edges"))
    counts = np.asarray(metrics["mismatch_bucket_num_tokens"])
    out = {}
    for name, values in metrics.items():
        stat = name.removeprefix("mismatch_bucket_")
        for i in np.flatnonzero(counts):
            out[f"mismatch_bucket/{stat}/{edges[i]:.0e}-{edges[i + 1]:.0e}"] = float(np.asarray(values)[i])
    return out
