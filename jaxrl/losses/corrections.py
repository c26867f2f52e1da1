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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl.losses._validate import check_ordered, check_positive
from jaxrl.losses.mismatch import _f32, _safe_div, sequence_log_ratio, token_log_ratio

__all__ = ["token_tis", "sequence_tis", "token_mis", "sequence_mis", "geo_rs"]


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
    old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, *, cap: float = 2.0
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Sequence masked IS: ``w = exp(log_r) * 1[exp(log_r) <= cap]`` on every token
    (docs/losses.md#mismatch-corrections).

    One-sided as in the blog (a small ratio only shrinks the update).

    Returns:
      ``(weight [B, T] float32 detached, keep [B, T] bool, metrics)``; metrics:
      ``seq_mis_masked_token_frac``, ``seq_mis_masked_seq_frac``,
      ``seq_mis_weight_mean`` (over the tokens kept).
    """
    check_positive("cap", cap)
    seq_log_r, _ = sequence_log_ratio(old_logp, rollout_logp, mask)
    valid = mask.astype(bool)
    rejected = jnp.broadcast_to((seq_log_r > math.log(cap))[:, None], valid.shape)
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
    multiplying if reweighting is wanted). The default band (1 +- 1e-3) is a
    choice; the sources give none (docs/losses.md#mismatch-corrections).

    Returns:
      ``(weight [B, T] float32 (1 kept, 0 rejected), keep [B, T] bool, metrics)``;
      metrics: ``geo_rs_masked_token_frac``, ``geo_rs_masked_seq_frac``,
      ``geo_rs_log_rho_geo_mean`` (mean of ``log_r / T_seq`` over sequences with tokens).
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
