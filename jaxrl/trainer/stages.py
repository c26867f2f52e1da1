"""The host-side stages of one RL step, each a function that returns its result and its own metrics.

A stage's metrics carry its prefix and no other stage writes them: ``rollout/``,
``reward/``, ``recompute/``, ``advantage/``, ``filter/``, ``update/``, ``push/``, and with
a critic (PPO with GAE) ``critic/`` for its scoring and its update (``jaxrl.trainer.critic``,
whose GAE stage replaces :func:`advantages`). The
engine-vs-learner divergences ``mismatch/*`` (and ``mismatch_bucket/*``) are measured once per
step, before the update: by the recompute, or with ``objective.bypass`` (no recompute) on
the update's first mini-batch.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl.losses import (ObjectiveConfig, batch_filter, kl_in_reward, mismatch_metrics,
                          mismatch_metrics_by_rollout_prob)
from jaxrl.losses.advantages import AdvantageConfig, sequence_advantages
from jaxrl.models.scoring import LogprobScorer
from jaxrl.trainer.batch import StepBatch


def rollout_metrics(samples: list) -> dict[str, float]:
    lengths = np.asarray([len(s.output_ids) for s in samples])
    return {"rollout/response_length_mean": float(lengths.mean()),
            "rollout/response_length_max": float(lengths.max())}


def reward_metrics(scored) -> dict[str, float]:
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
    return metrics


def recompute(batch: StepBatch, scorer: LogprobScorer, params, reference, *, bypass: bool
              ) -> tuple[StepBatch, dict[str, float]]:
    """``old_logp`` from the learner (or the engine's own under ``bypass``) and ``ref_logp``
    from the frozen ``reference`` parameters (when not None).

    Metrics: ``recompute/entropy``, the policy's token entropy on the whole batch before the
    update, and the mismatch between the recompute and the engine's logprobs.
    """
    metrics: dict[str, float] = {}
    if bypass:
        batch = batch.replace(old_logp=batch.rollout_logp)
    else:
        old_logp, entropy = scorer(params, *batch.model_inputs())
        batch = batch.replace(old_logp=old_logp)
        metrics["recompute/entropy"] = _masked_mean(entropy, batch.mask)
        metrics.update(measured_mismatch(batch))
    if reference is not None:
        batch = batch.replace(ref_logp=scorer(reference, *batch.model_inputs())[0])
    return batch, metrics


def measured_mismatch(batch: StepBatch) -> dict[str, float]:
    """``mismatch/*`` over the masked tokens, ``mismatch_bucket/*`` per rollout-probability bucket
    (docs/losses.md#mismatch-metrics: the mismatch concentrates on low-probability tokens)."""
    pair = (jnp.asarray(batch.old_logp), jnp.asarray(batch.rollout_logp), jnp.asarray(batch.mask))
    return {**mismatch_names(mismatch_metrics(*pair)), **_bucketed(mismatch_metrics_by_rollout_prob(*pair))}


def mismatch_names(metrics: dict) -> dict[str, float]:
    """The loss library's ``mismatch_<stat>`` -> the logged ``mismatch/<stat>``."""
    return {f"mismatch/{k.removeprefix('mismatch_')}": float(v) for k, v in metrics.items()}


def push_gap(batch: StepBatch) -> tuple[float, int]:
    """(max |old_logp - rollout_logp|, tokens) over every generated token, masked samples included:
    the spot check of the previous weight push needs no reward."""
    gap = np.abs(np.asarray(batch.old_logp) - np.asarray(batch.rollout_logp))[np.asarray(batch.generated)]
    return (float(gap.max()) if gap.size else float("nan")), int(gap.size)


def advantages(batch: StepBatch, scores: np.ndarray, valid: np.ndarray, config: AdvantageConfig,
               objective: ObjectiveConfig, group_size: int, greedy_scores: np.ndarray | None = None
               ) -> tuple[StepBatch, dict[str, float]]:
    """Per-token advantages (the sample's advantage on its masked tokens), after the KL penalty
    enters the reward when ``objective.kl_in_reward_coef > 0``. ``greedy_scores`` (one per
    prompt) is the baseline of "remax"; "opo" weighs its baseline by the generated lengths."""
    rewards = scores
    if objective.kl_in_reward_coef > 0:
        rewards = np.asarray(kl_in_reward(
            jnp.asarray(scores), jnp.asarray(batch.old_logp), jnp.asarray(batch.ref_logp), jnp.asarray(batch.mask),
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
    skip, metrics = batch_filter(
        jnp.asarray(batch.old_logp), jnp.asarray(batch.rollout_logp), jnp.asarray(batch.mask),
        threshold=objective.batch_filter_threshold, metric=objective.batch_filter_metric)
    return bool(skip), {f"filter/{k.removeprefix('batch_filter_')}": float(v) for k, v in metrics.items()}


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


def _masked_mean(values: np.ndarray, mask: np.ndarray) -> float:
    return float((values * mask).sum() / max(float(mask.sum()), 1.0))


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
