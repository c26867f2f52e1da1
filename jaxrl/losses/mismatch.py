"""Training-inference mismatch: log ratios, metrics and the batch filter (docs/losses.md#training-inference-mismatch).

With tokens sampled from the rollout policy ``q`` and ``r = p / q = exp(log_r_t)``
(``log_r_t = old_logp - rollout_logp``, learner minus rollout, over masked tokens),
the KL(q || p) estimators are ``k1 = -log r``, ``k2 = (log r)^2 / 2`` and
``k3 = r - 1 - log r`` (the blog's vllm-kl).

The corrections that reweight the policy gradient by these ratios are in
``jaxrl.losses.corrections``.

Shapes: ``[B, T]`` for every per-token array; ``mask`` is 1 on tokens the
policy generated. Every function is jittable: metrics are float32 scalars (or
fixed-size per-bucket arrays) in a dict, and statistics over an empty set
(no tokens in a bucket, turn or batch) come back as 0 with a count of 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses._validate import (
    check_choice,
    check_floating,
    check_integer,
    check_mask,
    check_rank,
    check_same_shape,
)

__all__ = ["DEFAULT_PROB_EDGES", "token_log_ratio", "sequence_log_ratio", "mismatch_metrics",
           "mismatch_metrics_by_rollout_prob", "mismatch_metrics_by_turn", "BATCH_FILTER_METRICS", "batch_filter"]

# Rollout-probability bucket edges: [0, 1e-8), [1e-8, 1e-7), ..., [0.1, 1].
DEFAULT_PROB_EDGES = (0.0,) + tuple(10.0 ** e for e in range(-8, 1))

_f32 = jnp.float32


def _check_pair(old_logp, rollout_logp, mask):
    check_floating("old_logp", old_logp)
    check_floating("rollout_logp", rollout_logp)
    check_mask("mask", mask)
    check_rank("mask", mask, 2)
    check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)


def token_log_ratio(old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """``log_r_t = old_logp - rollout_logp`` on masked tokens, 0 elsewhere (docs/losses.md#training-inference-mismatch).

    Args:
      old_logp: ``[B, T]`` float learner logprobs at sampling time.
      rollout_logp: ``[B, T]`` float rollout-engine logprobs of the same tokens.
      mask: ``[B, T]`` bool/0-1.
    Returns:
      ``[B, T]`` float32, detached (masked-out entries are 0 even if the inputs
      hold -inf or NaN there).

    Example (exported as ``jaxrl.losses.mismatch_token_log_ratio``):
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import mismatch_token_log_ratio
      >>> old_logp, rollout_logp = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -jnp.inf]])
      >>> mismatch_token_log_ratio(old_logp, rollout_logp, jnp.array([[1, 0]])).tolist()
      [[0.5, 0.0]]
    """
    _check_pair(old_logp, rollout_logp, mask)
    diff = jax.lax.stop_gradient(old_logp.astype(_f32) - rollout_logp.astype(_f32))
    return jnp.where(mask.astype(bool), diff, 0.0)


def sequence_log_ratio(
    old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sequence ``log_r = sum_t log_r_t`` over masked tokens (docs/losses.md#training-inference-mismatch).

    Returns:
      ``(log_r [B] float32, num_tokens [B] int32)``: the sum and the count of
      masked tokens of each sequence.

    Example (exported as ``jaxrl.losses.mismatch_sequence_log_ratio``): ``0.5 + 0.25`` over 2 tokens:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import mismatch_sequence_log_ratio
      >>> old_logp, rollout_logp = jnp.array([[-1.0, -1.0, 0.0]]), jnp.array([[-1.5, -1.25, 0.0]])
      >>> log_r, num_tokens = mismatch_sequence_log_ratio(old_logp, rollout_logp, jnp.array([[1, 1, 0]]))
      >>> [round(float(x), 4) for x in log_r], num_tokens.tolist()
      ([0.75], [2])
    """
    log_r = token_log_ratio(old_logp, rollout_logp, mask)
    return jnp.sum(log_r, axis=-1), jnp.sum(mask.astype(bool), axis=-1, dtype=jnp.int32)


def _safe_div(num, den):
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), 0.0)


def _token_stats(old_logp, rollout_logp, keep, segment, num_segments):
    """Token statistics per segment: dict of [num_segments] float32 arrays (+ int32 counts).

    ``segment`` [B, T] int in [0, num_segments); tokens with ``keep`` False go
    to an extra segment that is dropped.
    """
    seg = jnp.where(keep, segment, num_segments).reshape(-1)
    size = num_segments + 1
    log_r = jnp.where(keep, old_logp - rollout_logp, 0.0).reshape(-1)
    p_learner = jnp.exp(jnp.where(keep, old_logp, 0.0)).reshape(-1)
    p_rollout = jnp.exp(jnp.where(keep, rollout_logp, 0.0)).reshape(-1)

    def seg_sum(x):
        return jax.ops.segment_sum(x, seg, num_segments=size)

    count = seg_sum(jnp.ones_like(log_r))
    mean = lambda x: _safe_div(seg_sum(x), count)
    abs_log_r = jnp.abs(log_r)
    # Pearson in two passes (centred sums) to avoid cancellation in float32.
    dx = p_learner - mean(p_learner)[seg]
    dy = p_rollout - mean(p_rollout)[seg]
    var_product = seg_sum(dx * dx) * seg_sum(dy * dy)
    stats = {
        "k1": mean(-log_r),
        "k2": mean(0.5 * log_r**2),
        # expm1: exp(x) - 1 - x ~ x^2/2 would be rounding noise in float32 for |x| < 1e-3.
        "k3": mean(jnp.expm1(log_r) - log_r),
        "abs_log_ratio_mean": mean(abs_log_r),
        "abs_log_ratio_max": jnp.where(
            count > 0, jax.ops.segment_max(abs_log_r, seg, num_segments=size), 0.0),
        "prob_diff_mean": mean(jnp.abs(p_learner - p_rollout)),
        "prob_pearson": _safe_div(seg_sum(dx * dy), jnp.sqrt(var_product)),
        "chi2_token": mean(jnp.expm1(2.0 * log_r)),  # mean(r^2) - 1
    }
    stats = {k: v[:num_segments] for k, v in stats.items()}
    stats["num_tokens"] = count[:num_segments].astype(jnp.int32)
    return stats


def _sequence_stats(old_logp, rollout_logp, keep):
    """Per-sequence perplexities and sequence chi-squared, averaged over sequences with tokens."""
    count = jnp.sum(keep, axis=-1).astype(_f32)
    has_tokens = count > 0
    num_seqs = jnp.sum(has_tokens)
    mean_old = _safe_div(jnp.sum(jnp.where(keep, old_logp, 0.0), -1), count)
    mean_rollout = _safe_div(jnp.sum(jnp.where(keep, rollout_logp, 0.0), -1), count)
    seq_log_r = jnp.sum(jnp.where(keep, old_logp - rollout_logp, 0.0), -1)
    log_ppl_diff = mean_rollout - mean_old  # log ppl_learner - log ppl_rollout
    over_seqs = lambda x: _safe_div(jnp.sum(jnp.where(has_tokens, x, 0.0)), num_seqs)
    return {
        "ppl_learner": over_seqs(jnp.exp(-mean_old)),
        "ppl_rollout": over_seqs(jnp.exp(-mean_rollout)),
        "log_ppl_diff": over_seqs(log_ppl_diff),
        "log_ppl_abs_diff_max": jnp.max(jnp.where(has_tokens, jnp.abs(log_ppl_diff), 0.0)),
        "chi2_seq": over_seqs(jnp.expm1(2.0 * seq_log_r)),  # mean(exp(log_r)^2) - 1
        "num_seqs": num_seqs.astype(jnp.int32),
    }


def _batch_metrics(old_logp, rollout_logp, keep, prefix):
    token = _token_stats(old_logp, rollout_logp, keep, jnp.zeros(keep.shape, jnp.int32), 1)
    metrics = {k: v[0] for k, v in token.items()}
    metrics.update(_sequence_stats(old_logp, rollout_logp, keep))
    return {f"{prefix}{k}": v for k, v in metrics.items()}


def _as_f32(old_logp, rollout_logp, mask):
    return (jax.lax.stop_gradient(old_logp).astype(_f32),
            jax.lax.stop_gradient(rollout_logp).astype(_f32), mask.astype(bool))


def mismatch_metrics(
    old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """Every batch-level mismatch statistic of docs/losses.md#mismatch-metrics.

    Token level, over the ``N`` masked tokens (``r_t = exp(log_r_t)``,
    ``p = exp(old_logp)``, ``q = exp(rollout_logp)``):
    ``mismatch_k1 = mean(-log_r_t)``, ``mismatch_k2 = mean(log_r_t^2 / 2)``,
    ``mismatch_k3 = mean(r_t - 1 - log r_t)``, ``mismatch_abs_log_ratio_mean/max``
    of ``|log_r_t|``, ``mismatch_prob_diff_mean = mean|p - q|``,
    ``mismatch_prob_pearson = corr(p, q)`` (0 when either side is constant),
    ``mismatch_chi2_token = mean(r_t^2) - 1``, ``mismatch_num_tokens``.
    Sequence level, over sequences with at least one masked token:
    ``mismatch_ppl_learner`` / ``mismatch_ppl_rollout``: mean of
    ``exp(-mean_t logp)``; ``mismatch_log_ppl_diff``: mean of
    ``log ppl_learner - log ppl_rollout``, ``mismatch_log_ppl_abs_diff_max``;
    ``mismatch_chi2_seq = mean(exp(log_r)^2) - 1``; ``mismatch_num_seqs``.

    Args:
      old_logp, rollout_logp: ``[B, T]`` float.
      mask: ``[B, T]`` bool/0-1.
    Returns:
      dict of scalars: float32, counts int32.

    Example: ``log_r = [0.5, -0.5]``: k1 0, k2 ``0.125``, k3 ``((e^0.5 - 1.5) + (e^-0.5 - 0.5)) / 2``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import mismatch_metrics
      >>> m = mismatch_metrics(jnp.array([[-1.0, -1.0]]), jnp.array([[-1.5, -0.5]]), jnp.ones((1, 2)))
      >>> [round(float(m[k]), 4) for k in ("mismatch_k1", "mismatch_k2", "mismatch_k3")], int(m["mismatch_num_tokens"])
      ([0.0, 0.125, 0.1276], 2)
    """
    _check_pair(old_logp, rollout_logp, mask)
    return _batch_metrics(*_as_f32(old_logp, rollout_logp, mask), prefix="mismatch_")


def _check_edges(edges):
    try:
        values = np.asarray(edges, dtype=np.float64)
    except (TypeError, jax.errors.TracerArrayConversionError) as err:
        raise ValueError(f"edges must be a static sequence of floats, got {type(edges).__name__}") from err
    if values.ndim != 1 or values.size < 2:
        raise ValueError(f"edges has shape {values.shape} but at least 2 edges in a 1-D sequence were expected")
    if values[0] < 0 or values[-1] > 1 or np.any(np.diff(values) <= 0):
        raise ValueError(
            f"edges={values.tolist()} must increase strictly within [0, 1] "
            f"(probability bucket boundaries, e.g. DEFAULT_PROB_EDGES)")
    return values


def mismatch_metrics_by_rollout_prob(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    mask: jax.Array,
    *,
    edges: Sequence[float] = DEFAULT_PROB_EDGES,
) -> dict[str, jax.Array]:
    """Token mismatch statistics bucketed by rollout probability (docs/losses.md#mismatch-metrics).

    Bucket ``i`` holds the masked tokens with ``edges[i] <= exp(rollout_logp) < edges[i+1]``
    (the last bucket also takes ``edges[-1]``); tokens outside ``[edges[0], edges[-1]]``
    are counted in no bucket. The statistics are the token-level ones of
    :func:`mismatch_metrics` (k1, k2, k3, abs_log_ratio_mean/max, prob_diff_mean,
    prob_pearson, chi2_token, num_tokens).

    Args:
      old_logp, rollout_logp: ``[B, T]`` float.
      mask: ``[B, T]`` bool/0-1.
      edges: static increasing probabilities in [0, 1], ``K + 1`` of them.
    Returns:
      dict ``mismatch_bucket_<stat>`` -> ``[K]`` float32 (``num_tokens`` int32),
      0 in empty buckets, plus ``mismatch_bucket_edges`` ``[K + 1]``.

    Example: rollout probabilities ``exp(-1.5) = 0.22`` and ``exp(-0.5) = 0.61``, one per bucket,
    with ``log_r = 0.5`` and ``-0.5``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import mismatch_metrics_by_rollout_prob
      >>> old_logp, rollout_logp = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.5, -0.5]])
      >>> m = mismatch_metrics_by_rollout_prob(old_logp, rollout_logp, jnp.ones((1, 2)), edges=(0.0, 0.5, 1.0))
      >>> m["mismatch_bucket_num_tokens"].tolist(), [round(float(k), 4) for k in m["mismatch_bucket_k1"]]
      ([1, 1], [-0.5, 0.5])
    """
    _check_pair(old_logp, rollout_logp, mask)
    values = _check_edges(edges)
    old, rollout, keep = _as_f32(old_logp, rollout_logp, mask)
    num_buckets = values.size - 1
    prob = jnp.exp(rollout)
    edges_f32 = jnp.asarray(values, _f32)
    bucket = jnp.clip(jnp.searchsorted(edges_f32, prob, side="right") - 1, 0, num_buckets - 1)
    inside = (prob >= edges_f32[0]) & (prob <= edges_f32[-1])
    stats = _token_stats(old, rollout, keep & inside, bucket, num_buckets)
    metrics = {f"mismatch_bucket_{k}": v for k, v in stats.items()}
    metrics["mismatch_bucket_edges"] = edges_f32
    return metrics


def mismatch_metrics_by_turn(
    old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, turn_ids: jax.Array
) -> dict[str, jax.Array]:
    """:func:`mismatch_metrics` for the first model turn and for the later turns (docs/losses.md#mismatch-metrics).

    A sequence's first model turn is the smallest ``turn_ids`` value among its
    masked tokens; every masked token with a larger id is a later turn. Sequence
    statistics use each sequence's tokens of that split (a sequence with no such
    tokens is left out).

    Args:
      old_logp, rollout_logp: ``[B, T]`` float.
      mask: ``[B, T]`` bool/0-1.
      turn_ids: ``[B, T]`` integer, the model turn each token belongs to.
    Returns:
      dict with keys ``first_turn_<stat>`` and ``later_turns_<stat>`` for every
      ``<stat>`` of :func:`mismatch_metrics` (without its ``mismatch_`` prefix).

    Example: turn 0 has ``log_r = 0.5`` (k1 ``-0.5``), turn 1 ``log_r = -0.5`` (k1 ``0.5``):
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import mismatch_metrics_by_turn
      >>> old_logp, rollout_logp, turn_ids = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.5, -0.5]]), jnp.array([[0, 1]])
      >>> m = mismatch_metrics_by_turn(old_logp, rollout_logp, jnp.ones((1, 2)), turn_ids)
      >>> round(float(m["first_turn_k1"]), 4), round(float(m["later_turns_k1"]), 4)
      (-0.5, 0.5)
    """
    _check_pair(old_logp, rollout_logp, mask)
    check_integer("turn_ids", turn_ids)
    check_same_shape(turn_ids=turn_ids, mask=mask)
    old, rollout, keep = _as_f32(old_logp, rollout_logp, mask)
    big = jnp.iinfo(jnp.int32).max
    first_id = jnp.min(jnp.where(keep, turn_ids.astype(jnp.int32), big), axis=-1, keepdims=True)
    first = keep & (turn_ids == first_id)
    metrics = _batch_metrics(old, rollout, first, prefix="first_turn_")
    metrics.update(_batch_metrics(old, rollout, keep & ~first, prefix="later_turns_"))
    return metrics


BATCH_FILTER_METRICS = ("mismatch_k1", "mismatch_k2", "mismatch_k3", "mismatch_abs_log_ratio_mean",
                   "mismatch_abs_log_ratio_max", "mismatch_prob_diff_mean", "mismatch_chi2_token",
                   "mismatch_chi2_seq", "mismatch_log_ppl_abs_diff_max")


def batch_filter(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    mask: jax.Array,
    *,
    threshold: float,
    metric: str = "mismatch_k3",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Skip the whole update when a batch mismatch metric exceeds ``threshold`` (docs/losses.md#batch-filter).

    The caller must skip the optimizer step itself (``skip`` is a traced bool,
    e.g. for ``jax.lax.cond``): a zero loss is not a skipped step under Adam's
    momentum. Summing ``batch_filter_skip`` over steps counts the skips.

    Args:
      old_logp, rollout_logp: ``[B, T]`` float.
      mask: ``[B, T]`` bool/0-1.
      threshold: skip when ``metrics[metric] > threshold``.
      metric: a key of :func:`mismatch_metrics` (default the blog's vllm-kl, k3).
    Returns:
      ``(skip bool scalar, metrics)``; metrics: ``batch_filter_skip`` (int32
      0/1) and ``batch_filter_value`` (the metric's value).

    Example: k3 of ``log_r = [0.5, -0.5]`` is 0.1276 (see :func:`mismatch_metrics`), above 0.1:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import batch_filter
      >>> old_logp, rollout_logp = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.5, -0.5]])
      >>> skip, metrics = batch_filter(old_logp, rollout_logp, jnp.ones((1, 2)), threshold=0.1)
      >>> bool(skip), round(float(metrics["batch_filter_value"]), 4)
      (True, 0.1276)
    """
    check_choice("metric", metric, BATCH_FILTER_METRICS)
    value = mismatch_metrics(old_logp, rollout_logp, mask)[metric]
    skip = value > threshold
    return skip, {"batch_filter_skip": skip.astype(jnp.int32), "batch_filter_value": value}
