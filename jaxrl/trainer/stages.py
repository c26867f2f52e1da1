"""The host-side stages of one RL step, each a function that returns its result and its own metrics.

A stage's metrics carry its prefix and no other stage writes them: ``rollout/``, ``reward/``,
``recompute/`` (and ``routing/`` for an MoE engine's routes), ``advantage/``, ``filter/``,
``update/``, ``push/``, and with a critic (PPO with GAE) ``critic/`` for its scoring and its
update (``jaxrl.trainer.critic``, whose GAE stage replaces :func:`advantages`). The
engine-vs-learner divergences ``mismatch/*`` (and ``mismatch_bucket/*``) are measured once per
step, before the update: by the recompute, or with ``objective.bypass`` (no recompute) on
the update's first mini-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses import (ObjectiveConfig, batch_filter, kl_in_reward, mismatch_metrics,
                          mismatch_metrics_by_rollout_prob, mismatch_metrics_by_turn)
from jaxrl.losses.advantages import AdvantageConfig, sequence_advantages
from jaxrl.models.scoring import LogprobScorer
from jaxrl.rollout.base import LogprobKind, PushVerificationError
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.config import TrainConfig


def rollout_metrics(samples: list) -> dict[str, float]:
    lengths = np.asarray([len(s.output_ids) for s in samples])
    return {"rollout/response_length_mean": float(lengths.mean()),
            "rollout/response_length_max": float(lengths.max())}


def reward_metrics(scored, judge: dict[str, float] | None = None) -> dict[str, float]:
    """The batch's reward statistics, with the router's ``judge/*`` metrics (``RewardRouter.take_metrics``)
    as ``reward/judge/*``."""
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
    metrics.update({f"reward/{name}": value for name, value in (judge or {}).items()})
    return metrics


def objective_for_run(config: TrainConfig, builds_engine: bool) -> tuple[ObjectiveConfig, str]:
    """The objective the run trains with, and why (a line for the log).

    With ``update.recompute_old_logp: when_needed`` the learner's recompute of ``old_logp`` is
    skipped, through the bypass path (the engine's logprobs as ``old_logp``, the mismatch
    measured on the update's first mini-batch), when it is redundant: the trainer's own embedded
    sampler generates from the learner's parameter arrays, so its raw logprobs are the learner's
    up to the float32 residual of decoding (jaxrl.rollout.sampler), and a single mini-batch
    means the update's first forward is that same policy. Anything that reads the
    learner-versus-engine ratio (a mismatch correction or rejection, the batch filter) needs the
    recompute and keeps it.
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


def push_gap(batch: StepBatch) -> tuple[float, int]:
    """(max |old_logp - rollout_logp|, tokens) over every generated token, masked samples included:
    the spot check of the previous weight push needs no reward."""
    gap = np.abs(np.asarray(batch.old_logp) - np.asarray(batch.rollout_logp))[np.asarray(batch.generated)]
    return (float(gap.max()) if gap.size else float("nan")), int(gap.size)


def check_push(version: str, largest: float, tokens: int, *, tolerance: float) -> None:
    """Verifies a weight push: the engine's logprobs of the batch sampled with weights ``version``
    agree with the learner's recompute: ``largest`` (max |dlogp| over ``tokens`` generated
    tokens) within ``rollout.push_tolerance``. A check of zero tokens or a NaN fails: it
    proves nothing. Raises PushVerificationError."""
    if tokens == 0:
        raise PushVerificationError(
            f"the push check of weight version {version} compared zero generated tokens, so it proves nothing; "
            f"the engine returned no tokens (or, with objective.bypass, the first mini-batch has none in the "
            f"loss); set rollout.verify_push=false to run without the check")
    if not largest <= tolerance:
        raise PushVerificationError(
            f"the engine sampled with weight version {version} but its logprobs differ from the learner's "
            f"by up to {largest:.3g} nats > rollout.push_tolerance={tolerance}; the engine is not running "
            f"the learner's weights (or raise push_tolerance for low-precision engines)")


def advantages(batch: StepBatch, scores: np.ndarray, valid: np.ndarray, config: AdvantageConfig,
               objective: ObjectiveConfig, group_size: int, greedy_scores: np.ndarray | None = None
               ) -> tuple[StepBatch, dict[str, float]]:
    """Per-token advantages (the sample's advantage on its masked tokens), after the KL penalty
    enters the reward when ``objective.kl_in_reward_coef > 0``. ``greedy_scores`` (one per
    prompt) is the baseline of "remax"; "opo" weighs its baseline by the generated lengths."""
    rewards = scores
    if objective.kl_in_reward_coef > 0:
        rewards = np.asarray(_kl_in_reward(scores, batch.old_logp, batch.ref_logp, batch.mask,
                                           coef=objective.kl_in_reward_coef))
    lengths = np.asarray(batch.generated).sum(axis=1)
    adv, metrics = sequence_advantages(config, rewards, valid, group_size, lengths=lengths, baselines=greedy_scores)
    if greedy_scores is not None:
        metrics["advantage/greedy_reward_mean"] = float(np.mean(greedy_scores))
    return batch.replace(advantages=adv[:, None] * batch.mask), metrics


def batch_filter_stage(batch: StepBatch, objective: ObjectiveConfig) -> tuple[bool, dict[str, float]]:
    """Whether to skip the step's update because the engine and the learner disagree too much
    on this batch (``objective.batch_filter_threshold``; never under bypass, which has no recompute)."""
    if objective.batch_filter_threshold is None or objective.bypass:
        return False, {}
    skip, metrics = jax.device_get(_batch_filter(
        batch.old_logp, batch.rollout_logp, batch.mask,
        threshold=objective.batch_filter_threshold, metric=objective.batch_filter_metric))
    return bool(skip), {f"filter/{k.removeprefix('batch_filter_')}": float(v) for k, v in metrics.items()}


_kl_in_reward = jax.jit(kl_in_reward, static_argnames=("coef",))
_mismatch_by_turn = jax.jit(mismatch_metrics_by_turn)
_batch_filter = jax.jit(batch_filter, static_argnames=("threshold", "metric"))


def update_names(metrics: dict[str, Any]) -> dict[str, float]:
    """The train step's and the loss's metric names -> the logged ``update/<name>``; the loss's
    mismatch measurement (under bypass) keeps its own ``mismatch/`` family."""
    out = {}
    for name, value in metrics.items():
        if name.startswith("mismatch_"):
            out[f"mismatch/{name.removeprefix('mismatch_')}"] = float(value)
        else:
            out[name if name.startswith("update/") else f"update/{name}"] = float(value)
    return out


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
