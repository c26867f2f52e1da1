"""Training-inference mismatch corrections (docs/losses.md#training-inference-mismatch).

The rollout engine and the learner compute different numbers for the same
weights. Per token ``log_r_t = old_logp - rollout_logp`` (learner minus
rollout) over masked tokens; per sequence ``log_r = sum_t log_r_t``. The
ratios, the measurements of that gap (k1/k2/k3, per bucket, per turn) and the
batch filter are in ``jaxrl.losses.mismatch``.

Shapes: ``[B, T]`` for every per-token array; ``mask`` is 1 on tokens the
policy generated. Every function is jittable.

Corrections return ``(weight, keep, metrics)``: a detached float32 weight that
multiplies the policy-gradient term, the tokens still used, and the fraction
of tokens and sequences the correction clipped or masked. Bypass (Ring-Linear
eq. 5) needs no function: pass ``rollout_logp`` as ``old_logp`` to the policy
loss.

Corrections are IS weights (``IS_WEIGHTS``: token / sequence TIS) or
rejections (``REJECTIONS``: token / sequence MIS, Geo-RS, sequence k2/k3
rejection); :func:`combine_corrections` multiplies one of each, and
:func:`batch_normalize_is_weights` rescales any weight to batch mean 1.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl.losses._validate import (
    check_choice,
    check_floating,
    check_mask,
    check_ordered,
    check_positive,
    check_rank,
    check_same_shape,
)
from jaxrl.losses.mismatch import _f32, _safe_div, sequence_log_ratio, token_log_ratio

__all__ = ["token_tis", "sequence_tis", "token_mis", "sequence_mis", "geo_rs", "sequence_kl_rs",
           "batch_normalize_is_weights", "combine_corrections", "IS_WEIGHTS", "REJECTIONS",
           "REJECTED_TOKEN_FRACTION", "KL_RS_ESTIMATORS", "KL_RS_AGGREGATES", "IS_NORMALIZE_LEVELS"]

KL_RS_ESTIMATORS = ("k2", "k3")
KL_RS_AGGREGATES = ("sum", "mean", "max")
IS_NORMALIZE_LEVELS = ("token", "sequence")


# --------------------------------------------------------------------------- #
# Corrections
# --------------------------------------------------------------------------- #
def _affected_fractions(name, affected, keep):
    """Fraction of masked tokens, and of sequences with masked tokens, that ``affected`` touches."""
    affected = affected & keep
    has_tokens = jnp.any(keep, axis=-1)
    return {
        f"{name}_token_frac": _safe_div(jnp.sum(affected).astype(_f32), jnp.sum(keep).astype(_f32)),
        f"{name}_seq_frac": _safe_div(jnp.sum(jnp.any(affected, axis=-1)).astype(_f32),
                                      jnp.sum(has_tokens).astype(_f32)),
    }


def _weight_mean(name, weight, keep):
    return {f"{name}_weight_mean": _safe_div(jnp.sum(jnp.where(keep, weight, 0.0)),
                                             jnp.sum(keep).astype(_f32))}


def token_tis(
    old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, *, cap: float = 2.0
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Token truncated IS: ``w_t = min(exp(log_r_t), cap)`` (docs/losses.md#mismatch-corrections).

    Returns:
      ``(weight [B, T] float32 detached (0 off mask), keep [B, T] bool (= mask),
      metrics)``; metrics: ``token_tis_clipped_token_frac``,
      ``token_tis_clipped_seq_frac`` (tokens with ``exp(log_r_t) > cap``),
      ``token_tis_weight_mean``.

    Example: ``log_r = [0.5, 1.0]``: ``exp(0.5)`` and ``exp(1) = 2.718`` capped at 2:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import token_tis
      >>> old_logp, rollout_logp = jnp.array([[-0.5, -1.0]]), jnp.array([[-1.0, -2.0]])
      >>> weight, _, metrics = token_tis(old_logp, rollout_logp, jnp.ones((1, 2)), cap=2.0)
      >>> [round(float(w), 4) for w in weight[0]], float(metrics["token_tis_clipped_token_frac"])
      ([1.6487, 2.0], 0.5)
    """
    check_positive("cap", cap)
    log_r = token_log_ratio(old_logp, rollout_logp, mask)
    keep = mask.astype(bool)
    weight = jnp.where(keep, jnp.exp(jnp.minimum(log_r, math.log(cap))), 0.0)
    metrics = _affected_fractions("token_tis_clipped", log_r > math.log(cap), keep)
    metrics.update(_weight_mean("token_tis", weight, keep))
    return weight, keep, metrics


def sequence_tis(
    old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, *, cap: float = 2.0
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Sequence truncated IS: ``w = min(exp(sum_t log_r_t), cap)`` on every token of the sequence
    (docs/losses.md#mismatch-corrections).

    The blog uses ``cap = 2``. Computed as ``exp(min(log_r, log cap))`` so long
    sequences cannot overflow.

    Returns:
      ``(weight [B, T] float32 detached, keep [B, T] bool (= mask), metrics)``;
      metrics: ``seq_tis_clipped_token_frac``, ``seq_tis_clipped_seq_frac``,
      ``seq_tis_weight_mean``.

    Example: sequence ``log_r`` 0.5 (``exp(0.5)``) and 1.0 (``exp(1)`` capped at 2):
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import sequence_tis
      >>> old_logp, rollout_logp = jnp.array([[-0.75, -0.75], [-0.5, -0.5]]), jnp.full((2, 2), -1.0)
      >>> weight, _, _ = sequence_tis(old_logp, rollout_logp, jnp.ones((2, 2)), cap=2.0)
      >>> [[round(float(w), 4) for w in row] for row in weight]
      [[1.6487, 1.6487], [2.0, 2.0]]
    """
    check_positive("cap", cap)
    seq_log_r, _ = sequence_log_ratio(old_logp, rollout_logp, mask)
    keep = mask.astype(bool)
    weight = jnp.where(keep, jnp.exp(jnp.minimum(seq_log_r, math.log(cap)))[:, None], 0.0)
    clipped = jnp.broadcast_to((seq_log_r > math.log(cap))[:, None], keep.shape)
    metrics = _affected_fractions("seq_tis_clipped", clipped, keep)
    metrics.update(_weight_mean("seq_tis", weight, keep))
    return weight, keep, metrics


def token_mis(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    mask: jax.Array,
    *,
    c_low: float = 2.0,
    c_high: float = 5.0,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Token masked IS / IcePop: ``w_t = exp(log_r_t)`` if ``1/c_low <= exp(log_r_t) <= c_high``, else masked
    (docs/losses.md#mismatch-corrections).

    Two-sided; the defaults are IcePop's band ``[0.5, 5]``.

    Returns:
      ``(weight [B, T] float32 detached (0 where masked), keep [B, T] bool,
      metrics)``; metrics: ``token_mis_masked_token_frac``,
      ``token_mis_masked_seq_frac`` (sequences with at least one masked token),
      ``token_mis_weight_mean`` (over the tokens kept).

    Example: ``log_r = [0.5, 2.0]``: ``exp(0.5)`` is in ``[0.5, 5]``, ``exp(2) = 7.39`` is masked:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import token_mis
      >>> old_logp, rollout_logp = jnp.array([[-0.5, -1.0]]), jnp.array([[-1.0, -3.0]])
      >>> weight, keep, _ = token_mis(old_logp, rollout_logp, jnp.ones((1, 2)))
      >>> [round(float(w), 4) for w in weight[0]], keep.tolist()
      ([1.6487, 0.0], [[True, False]])
    """
    check_positive("c_low", c_low)
    check_positive("c_high", c_high)
    check_ordered("1/c_low", 1.0 / c_low, "c_high", c_high)
    log_r = token_log_ratio(old_logp, rollout_logp, mask)
    valid = mask.astype(bool)
    inside = (log_r >= -math.log(c_low)) & (log_r <= math.log(c_high))
    keep = valid & inside
    weight = jnp.where(keep, jnp.exp(log_r), 0.0)
    metrics = _affected_fractions("token_mis_masked", ~inside, valid)
    metrics.update(_weight_mean("token_mis", weight, keep))
    return weight, keep, metrics


def sequence_mis(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    mask: jax.Array,
    *,
    cap: float = 2.0,
    lower: float | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Sequence masked IS: ``w = exp(log_r) * 1[lower <= exp(log_r) <= cap]`` on every token
    (docs/losses.md#mismatch-corrections).

    One-sided by default, as in the blog (a small ratio only shrinks the
    update): ``lower=None`` rejects only above ``cap``. A ``lower`` in
    ``(0, cap]`` also rejects sequences whose ratio is below it, a two-sided
    trust region (verl's "seq_sum_k1" rejection bounds ``exp(-log_r)``, i.e.
    its ``"a_b"`` is ``lower=1/b, cap=1/a`` here).

    Returns:
      ``(weight [B, T] float32 detached, keep [B, T] bool, metrics)``; metrics:
      ``seq_mis_masked_token_frac``, ``seq_mis_masked_seq_frac``,
      ``seq_mis_weight_mean`` (over the tokens kept).

    Example: sequence ratios ``exp(0.5) <= 2`` (kept) and ``exp(1) > 2`` (rejected):
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import sequence_mis
      >>> old_logp, rollout_logp = jnp.array([[-0.75, -0.75], [-0.5, -0.5]]), jnp.full((2, 2), -1.0)
      >>> weight, keep, _ = sequence_mis(old_logp, rollout_logp, jnp.ones((2, 2)), cap=2.0)
      >>> [[round(float(w), 4) for w in row] for row in weight], keep.tolist()
      ([[1.6487, 1.6487], [0.0, 0.0]], [[True, True], [False, False]])
    """
    check_positive("cap", cap)
    if lower is not None:
        check_positive("lower", lower)
        check_ordered("lower", lower, "cap", cap)
    seq_log_r, _ = sequence_log_ratio(old_logp, rollout_logp, mask)
    valid = mask.astype(bool)
    out = seq_log_r > math.log(cap)
    if lower is not None:
        out = out | (seq_log_r < math.log(lower))
    rejected = jnp.broadcast_to(out[:, None], valid.shape)
    keep = valid & ~rejected
    weight = jnp.where(keep, jnp.exp(jnp.minimum(seq_log_r, math.log(cap)))[:, None], 0.0)
    metrics = _affected_fractions("seq_mis_masked", rejected, valid)
    metrics.update(_weight_mean("seq_mis", weight, keep))
    return weight, keep, metrics


def geo_rs(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    mask: jax.Array,
    *,
    lower: float = 0.999,
    upper: float = 1.001,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Geometric-mean rejection: keep a sequence iff ``lower <= exp(log_r / T_seq) <= upper``
    (docs/losses.md#mismatch-corrections).

    ``T_seq`` is the sequence's count of masked tokens, so the band is a
    per-token trust region that does not reject long sequences systematically.
    Pure rejection: kept tokens get weight 1 (combine with a TIS weight by
    multiplying if reweighting is wanted). The default band is verl's
    ``decoupled_geo_rs`` preset (``rs_threshold=1.001``, lower 0.999), meant
    for long responses from an engine that matches the learner closely: the
    geometric mean of T tokens spreads like ``1/sqrt(T)``, so on short
    responses this band rejects nearly everything. ``ObjectiveConfig``
    defaults to a wider band, measured on the demo (docs/losses.md#the-geo-rs-band).

    Returns:
      ``(weight [B, T] float32 (1 kept, 0 rejected), keep [B, T] bool, metrics)``;
      metrics: ``geo_rs_masked_token_frac``, ``geo_rs_masked_seq_frac``,
      ``geo_rs_log_rho_geo_mean`` (mean of ``log_r / T_seq`` over sequences with tokens).

    Example: geometric means ``exp(0) = 1`` (kept) and ``exp(0.01) > 1.001`` (rejected):
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import geo_rs
      >>> old_logp, rollout_logp = jnp.array([[-1.0, -1.0], [-0.99, -0.99]]), jnp.full((2, 2), -1.0)
      >>> weight, keep, _ = geo_rs(old_logp, rollout_logp, jnp.ones((2, 2)))
      >>> weight.tolist(), keep.tolist()
      ([[1.0, 1.0], [0.0, 0.0]], [[True, True], [False, False]])
    """
    check_positive("lower", lower)
    check_ordered("lower", lower, "upper", upper)
    seq_log_r, num_tokens = sequence_log_ratio(old_logp, rollout_logp, mask)
    valid = mask.astype(bool)
    has_tokens = num_tokens > 0
    log_rho_geo = _safe_div(seq_log_r, num_tokens.astype(_f32))
    inside = (log_rho_geo >= math.log(lower)) & (log_rho_geo <= math.log(upper))
    keep = valid & inside[:, None]
    metrics = _affected_fractions("geo_rs_masked", ~inside[:, None] & valid, valid)
    metrics["geo_rs_log_rho_geo_mean"] = _safe_div(
        jnp.sum(jnp.where(has_tokens, log_rho_geo, 0.0)), jnp.sum(has_tokens).astype(_f32))
    return keep.astype(_f32), keep, metrics


def sequence_kl_rs(
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    mask: jax.Array,
    *,
    estimator: str = "k3",
    aggregate: str = "mean",
    threshold: float = 0.01,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Sequence KL rejection: reject sequence ``i`` iff ``agg_t k(log_r_t) > threshold`` over its masked tokens
    (docs/losses.md#mismatch-corrections; verl ``rollout_corr_helper.compute_rollout_rejection_mask``,
    options "seq_{sum,mean,max}_k{2,3}").

    ``k2 = (log_r_t)^2 / 2`` and ``k3 = exp(log_r_t) - 1 - log_r_t``, the
    per-token estimators of KL(rollout || learner) that ``mismatch`` reports;
    ``agg`` is the sum, the mean (over the sequence's masked tokens) or the
    max. Pure rejection, as :func:`geo_rs`: kept tokens get weight 1. verl
    clips ``log_r_t`` to [-20, 20] first; here k is exact (an overflow is
    +inf, which rejects). The defaults are verl's k3-RS preset ("seq_mean_k3",
    0.01); the sum and the max need their own threshold.

    Args:
      old_logp, rollout_logp: ``[B, T]`` float; mask: ``[B, T]`` bool/0-1.
      estimator: "k2" | "k3"; aggregate: "sum" | "mean" | "max";
      threshold: > 0, the largest aggregate kept.
    Returns:
      ``(weight [B, T] float32 (1 kept, 0 rejected or off mask), keep [B, T] bool, metrics)``;
      metrics: ``seq_kl_rs_masked_token_frac``, ``seq_kl_rs_masked_seq_frac``,
      ``seq_kl_rs_value_mean`` (mean of the aggregate over sequences with tokens).

    Example: mean k3 of ``log_r = [0, 0]`` is 0 (kept), of ``[0.5, 0.5]`` it is
    ``exp(0.5) - 1.5 = 0.1487 > 0.01`` (rejected); the batch mean is ``0.1487 / 2``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import sequence_kl_rs
      >>> old_logp, rollout_logp = jnp.array([[-1.0, -1.0], [-0.5, -0.5]]), jnp.full((2, 2), -1.0)
      >>> _, keep, metrics = sequence_kl_rs(old_logp, rollout_logp, jnp.ones((2, 2)), estimator="k3", threshold=0.01)
      >>> keep.tolist(), round(float(metrics["seq_kl_rs_value_mean"]), 4)
      ([[True, True], [False, False]], 0.0744)
    """
    check_choice("estimator", estimator, KL_RS_ESTIMATORS)
    check_choice("aggregate", aggregate, KL_RS_AGGREGATES)
    check_positive("threshold", threshold)
    log_r = token_log_ratio(old_logp, rollout_logp, mask)
    valid = mask.astype(bool)
    per_token = 0.5 * log_r**2 if estimator == "k2" else jnp.expm1(log_r) - log_r
    per_token = jnp.where(valid, per_token, 0.0)
    num_tokens = jnp.sum(valid, axis=-1)
    has_tokens = num_tokens > 0
    if aggregate == "sum":
        value = jnp.sum(per_token, axis=-1)
    elif aggregate == "mean":
        value = _safe_div(jnp.sum(per_token, axis=-1), num_tokens.astype(_f32))
    else:
        value = jnp.where(has_tokens, jnp.max(jnp.where(valid, per_token, -jnp.inf), axis=-1), 0.0)
    rejected = jnp.broadcast_to((value > threshold)[:, None], valid.shape)
    keep = valid & ~rejected
    metrics = _affected_fractions("seq_kl_rs_masked", rejected, valid)
    metrics["seq_kl_rs_value_mean"] = _safe_div(
        jnp.sum(jnp.where(has_tokens, value, 0.0)), jnp.sum(has_tokens).astype(_f32))
    return keep.astype(_f32), keep, metrics


def batch_normalize_is_weights(
    weight: jax.Array,
    mask: jax.Array,
    *,
    level: str = "token",
    batch_mean: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """IS weight batch normalisation: ``w / mean(w)`` so the weights average 1 over the batch
    (docs/losses.md#mismatch-corrections; verl ``compute_rollout_correction_weights`` with
    ``rollout_is_batch_normalize``).

    * "token" (for token-level weights): ``mean = sum_{i,t} m w / sum_{i,t} m``;
    * "sequence" (for sequence-level weights): ``mean = mean_i (sum_t m w / sum_t m)``
      over the sequences with masked tokens, so each sequence counts once
      whatever its length.

    As verl, the weights are left unchanged (factor 1) when ``mean <= 1e-8``.
    The mean is a statistic of the batch: with micro-batches, call this once on
    the optimizer step's whole batch and pass its ``is_batch_norm_factor``
    to each micro-batch's call as ``batch_mean``.

    Args:
      weight: ``[B, T]`` float, e.g. the weight of any correction (detached here).
      mask: ``[B, T]`` bool/0-1: the tokens the mean runs over (the correction's ``keep``).
      level: "token" | "sequence".
      batch_mean: a precomputed mean (scalar) to divide by instead of this batch's.
    Returns:
      ``(weight [B, T] float32 detached, 0 off mask; metrics)``; metrics:
      ``is_batch_norm_factor`` (the divisor used).

    Example: token mean of ``[1, 3]`` is 2:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import batch_normalize_is_weights
      >>> weight, metrics = batch_normalize_is_weights(jnp.array([[1.0, 3.0]]), jnp.ones((1, 2)), level="token")
      >>> [round(float(w), 4) for w in weight[0]], float(metrics["is_batch_norm_factor"])
      ([0.5, 1.5], 2.0)
    """
    check_floating("weight", weight)
    check_mask("mask", mask)
    check_rank("weight", weight, 2)
    check_same_shape(weight=weight, mask=mask)
    check_choice("level", level, IS_NORMALIZE_LEVELS)
    live = mask.astype(bool)
    w = jnp.where(live, jax.lax.stop_gradient(weight).astype(_f32), 0.0)
    if batch_mean is None:
        count = jnp.sum(live, axis=-1).astype(_f32)
        if level == "token":
            mean = _safe_div(jnp.sum(w), jnp.sum(count))
        else:
            has_tokens = count > 0
            mean = _safe_div(jnp.sum(_safe_div(jnp.sum(w, axis=-1), count)), jnp.sum(has_tokens).astype(_f32))
    else:
        mean = jnp.asarray(batch_mean, _f32)
    factor = jnp.where(mean > 1e-8, mean, 1.0)
    return w / factor, {"is_batch_norm_factor": factor}


def combine_corrections(
    is_correction: tuple[jax.Array, jax.Array, dict[str, jax.Array]],
    rejection: tuple[jax.Array, jax.Array, dict[str, jax.Array]],
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """One IS weight times one rejection: ``w = w_IS * 1[keep_IS & keep_RS]``
    (docs/losses.md#mismatch-corrections; verl ``compute_rollout_correction_and_rejection_mask``).

    Only the rejection's ``keep`` is used, not its weight: token / sequence
    MIS used as a rejection here drops what it would mask but does not
    reweight (the IS correction does). E.g. seq-TIS + Geo-RS is verl's
    "decoupled_geo_rs_seq_tis" preset, seq-TIS + seq-k3-RS its "decoupled_k3_rs_seq_tis".

    Args:
      is_correction: ``(weight, keep, metrics)`` of an IS weight (``IS_WEIGHTS``:
        :func:`token_tis`, :func:`sequence_tis`).
      rejection: ``(weight, keep, metrics)`` of a rejection (``REJECTIONS``:
        :func:`token_mis`, :func:`sequence_mis`, :func:`geo_rs`, :func:`sequence_kl_rs`).
    Returns:
      ``(weight [B, T] float32 detached, keep [B, T] bool, metrics)``: both
      corrections' metrics (their names do not overlap) and
      ``correction_weight_mean`` (over the tokens kept).

    Example: token-TIS weights ``[exp(0.5), 2]`` (``log_r = [0.5, 2.0]``, cap 2) on the tokens
    token-MIS keeps (``exp(2) > 5`` is masked):
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import combine_corrections, token_mis, token_tis
      >>> old_logp, rollout_logp, mask = jnp.array([[-0.5, -1.0]]), jnp.array([[-1.0, -3.0]]), jnp.ones((1, 2))
      >>> tis, mis = token_tis(old_logp, rollout_logp, mask), token_mis(old_logp, rollout_logp, mask)
      >>> weight, keep, _ = combine_corrections(tis, mis)
      >>> [round(float(w), 4) for w in weight[0]], keep.tolist()
      ([1.6487, 0.0], [[True, False]])
    """
    is_weight, is_keep, is_metrics = is_correction
    _, rs_keep, rs_metrics = rejection
    check_same_shape(is_weight=is_weight, is_keep=is_keep, rejection_keep=rs_keep)
    clash = sorted(set(is_metrics) & set(rs_metrics))
    if clash:
        raise ValueError(f"is_correction and rejection both report {clash}; combine two different corrections "
                         "(one IS weight, one rejection)")
    keep = jnp.asarray(is_keep).astype(bool) & jnp.asarray(rs_keep).astype(bool)
    weight = jnp.where(keep, jax.lax.stop_gradient(is_weight).astype(_f32), 0.0)
    metrics = {**is_metrics, **rs_metrics}
    metrics.update(_weight_mean("correction", weight, keep))
    return weight, keep, metrics


IS_WEIGHTS = (token_tis, sequence_tis)  # the corrections that reweight every token they keep
# The corrections that drop tokens or sequences -> the metric of the fraction of masked tokens each drops.
REJECTED_TOKEN_FRACTION = {token_mis: "token_mis_masked_token_frac", sequence_mis: "seq_mis_masked_token_frac",
                           geo_rs: "geo_rs_masked_token_frac", sequence_kl_rs: "seq_kl_rs_masked_token_frac"}
REJECTIONS = tuple(REJECTED_TOKEN_FRACTION)
