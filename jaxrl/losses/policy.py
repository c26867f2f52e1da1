"""Policy-gradient surrogate losses and their aggregation (docs/losses.md#policy-losses).

All token losses take ``[B, T]`` arrays (``B`` sequences, ``T`` positions),
return a ``[B, T]`` float32 loss that is zero on masked-out tokens plus a dict
of metrics, and compute ratios in log space, exponentiating last. A masked-out
token's ``logp``, ``old_logp`` or advantage never reaches a loss value, a
gradient or a metric.

Aggregation divides by a normaliser computed once on the *global* batch
(:func:`loss_normalizer`) so that summing the losses of micro-batches gives the
full-batch loss and gradient whatever the split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate

Array = jax.Array

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_token_inputs(logp, old_logp, advantages, mask) -> None:
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        _validate.check_floating(name, x)
    _validate.check_mask("mask", mask)
    _validate.check_rank("logp", logp, 2)
    _validate.check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)


def _check_clip_args(eps_low, eps_high, dual_clip) -> None:
    _validate.check_interval("eps_low", eps_low, 0.0, 1.0)
    _validate.check_positive("eps_high", eps_high, allow_zero=True)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip={dual_clip!r} but a value > 1 (e.g. 3.0) or None was expected")


def masked_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    """``log rho_t = logp - old_logp`` on masked tokens, 0 elsewhere (docs/losses.md#policy-losses),
    float32 ``[B, T]``."""
    live = jnp.asarray(mask).astype(bool)
    diff = jnp.asarray(logp, jnp.float32) - jnp.asarray(old_logp, jnp.float32)
    return jnp.where(live, diff, 0.0)


def gspo_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    """GSPO ``log s_i = mean_t(logp - old_logp)`` over masked tokens (docs/losses.md#gspo-and-gspo-token).

    Args: ``logp``, ``old_logp`` float ``[B, T]``; ``mask`` ``[B, T]``.
    Returns: float32 ``[B]``; 0 for a sequence without masked tokens.
    """
    _validate.check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    _validate.check_rank("logp", logp, 2)
    counts = jnp.sum(jnp.asarray(mask, jnp.float32), axis=-1)
    return jnp.sum(masked_log_ratio(logp, old_logp, mask), axis=-1) / jnp.maximum(counts, 1.0)


def _clipped_surrogate(log_ratio, advantages, mask, eps_low, eps_high, dual_clip):
    """``max(-rho A, -clip(rho) A)`` [then ``min(., -c A)`` for A<0] and the clip metrics."""
    live = jnp.asarray(mask).astype(bool)
    adv = jnp.where(live, jnp.asarray(advantages, jnp.float32), 0.0)
    ratio = jnp.exp(log_ratio)
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    # The clipped branch is the one taken exactly where its gradient vanishes.
    clipped_high = live & (adv > 0) & (ratio > 1.0 + eps_high)
    clipped_low = live & (adv < 0) & (ratio < 1.0 - eps_low)
    if dual_clip is None:
        dual_clipped = jnp.zeros_like(live)
    else:
        dual_clipped = live & (adv < 0) & (ratio > dual_clip)
        loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * dual_clip), loss)
    loss = jnp.where(live, loss, 0.0)
    n = jnp.maximum(jnp.sum(live), 1).astype(jnp.float32)
    ratio_live = jnp.where(live, ratio, 0.0)
    metrics = {
        "clip_frac_high": jnp.sum(clipped_high) / n,
        "clip_frac_low": jnp.sum(clipped_low) / n,
        "dual_clip_frac": jnp.sum(dual_clipped) / n,
        "clip_frac": jnp.sum(clipped_high | clipped_low | dual_clipped) / n,
        "ratio_mean": jnp.sum(ratio_live) / n,
        "ratio_max": jnp.max(ratio_live),
    }
    return loss, metrics


def ppo_clip_token_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PPO clip ``-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)``, dual clip ``min(., -c A)`` for ``A<0``
    (docs/losses.md#ppo-clip-with-clip-higher-and-dual-clip).

    Args:
      logp: float ``[B, T]``, carries gradient; old_logp: float ``[B, T]``
        (treated as a constant); advantages: float ``[B, T]``; mask: ``[B, T]``.
      eps_low, eps_high: asymmetric clip range (clip-higher: eps_high > eps_low).
      dual_clip: ``c > 1`` bounding the loss of ``A < 0`` tokens by ``-c A``, or None.
    Returns:
      token loss float32 ``[B, T]`` (0 on masked tokens), metrics over masked
      tokens: ``clip_frac_high`` (A>0, rho > 1+eps_high), ``clip_frac_low``
      (A<0, rho < 1-eps_low), ``dual_clip_frac`` (A<0, rho > c), ``clip_frac``
      (any of them: the tokens with zero gradient), ``ratio_mean``, ``ratio_max``.
    """
    _check_token_inputs(logp, old_logp, advantages, mask)
    _check_clip_args(eps_low, eps_high, dual_clip)
    log_ratio = masked_log_ratio(logp, jax.lax.stop_gradient(old_logp), mask)
    return _clipped_surrogate(log_ratio, advantages, mask, eps_low, eps_high, dual_clip)


def gspo_token_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    dual_clip: float | None = None,
    token_gradient: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """GSPO ``-min(s A, clip(s, 1-eps_low, 1+eps_high) A)``, ``s_i = exp(mean_t(logp - old_logp))``
    (docs/losses.md#gspo-and-gspo-token).

    The sequence ratio ``s_i`` multiplies every token's advantage, so the usual
    per-sequence advantage broadcast to tokens gives the GSPO objective under
    "seq-mean-token-mean" aggregation. With ``token_gradient=True`` this is
    GSPO-token: ``s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t])`` has the value
    (and clip decision) of ``s_i`` but sends each token's gradient through its
    own log-probability, which allows token-varying advantages.

    Args/Returns: as :func:`ppo_clip_token_loss` (all fractions are of tokens;
    a clipped sequence clips all its tokens). Default eps are the GSPO paper's
    (3e-4, 4e-4): sequence ratios sit much closer to 1 than token ratios.
    """
    _check_token_inputs(logp, old_logp, advantages, mask)
    _check_clip_args(eps_low, eps_high, dual_clip)
    seq_log_ratio = gspo_log_ratio(logp, jax.lax.stop_gradient(old_logp), mask)[:, None]
    if token_gradient:
        logp32 = jnp.asarray(logp, jnp.float32)
        own = masked_log_ratio(logp32, jax.lax.stop_gradient(logp32), mask)
        log_ratio = jax.lax.stop_gradient(seq_log_ratio) + own
    else:
        log_ratio = jnp.broadcast_to(seq_log_ratio, jnp.shape(logp))
    return _clipped_surrogate(log_ratio, advantages, mask, eps_low, eps_high, dual_clip)


# Policy loss name -> its token loss, called as ``fn(logp, old_logp, advantages, mask, *, eps_low,
# eps_high, dual_clip)``; the one declaration of the policy-loss choices.
POLICY_LOSSES = {
    "ppo": ppo_clip_token_loss,
    "gspo": gspo_token_loss,
    "gspo-token": functools.partial(gspo_token_loss, token_gradient=True),
}


def policy_token_loss(
    kind: str,
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Dispatches ``kind`` in ``POLICY_LOSSES`` ("ppo", "gspo", "gspo-token") to its token loss
    (docs/losses.md#policy-losses).

    Shapes as :func:`ppo_clip_token_loss`.
    """
    _validate.check_choice("kind", kind, POLICY_LOSSES)
    return POLICY_LOSSES[kind](logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                               dual_clip=dual_clip)


def loss_normalizer(mode: str, mask: Array, *, max_length: int | None = None) -> Array:
    """The divisor of :func:`aggregate_loss` for ``mode``, computed on the GLOBAL batch mask
    (docs/losses.md#loss-aggregation).

    * "token-mean": number of masked tokens;
    * "seq-mean-token-sum", "seq-mean-token-mean": number of sequences with at
      least one masked token;
    * "seq-mean-token-sum-norm" (Dr.GRPO): that sequence count times the
      constant ``max_length`` (default ``T``, the padded length).

    Args: mask ``[B, T]`` of the whole batch (all micro-batches together).
    Returns: float32 scalar, at least 1.
    """
    _validate.check_choice("mode", mode, AGGREGATION_MODES)
    _validate.check_mask("mask", mask)
    _validate.check_rank("mask", mask, 2)
    live = jnp.asarray(mask, jnp.float32)
    if mode == "token-mean":
        count = jnp.sum(live)
    else:
        count = jnp.sum(jnp.any(live > 0, axis=-1)).astype(jnp.float32)
        if mode == "seq-mean-token-sum-norm":
            length = jnp.shape(mask)[1] if max_length is None else max_length
            _validate.check_positive("max_length", length)
            count = count * length
    return jnp.maximum(count, 1.0)


def aggregate_loss(token_loss: Array, mask: Array, mode: str, normalizer: Array | float) -> Array:
    """Reduces a ``[B, T]`` token loss to a scalar: ``sum_{b,t} m l / N`` or, for "seq-mean-token-mean",
    ``sum_b (sum_t m l / sum_t m) / N`` (docs/losses.md#loss-aggregation).

    ``normalizer`` ``N`` comes from :func:`loss_normalizer` on the global batch,
    so the sum of this over micro-batches equals the full-batch value (and
    gradient) for every split.

    Args: token_loss float ``[B, T]``; mask ``[B, T]``; mode in
      ``AGGREGATION_MODES``; normalizer a positive scalar.
    Returns: float32 scalar.
    """
    _validate.check_choice("mode", mode, AGGREGATION_MODES)
    _validate.check_floating("token_loss", token_loss)
    _validate.check_mask("mask", mask)
    _validate.check_rank("token_loss", token_loss, 2)
    _validate.check_same_shape(token_loss=token_loss, mask=mask)
    _validate.check_rank("normalizer", normalizer, 0)
    live = jnp.asarray(mask).astype(bool)
    values = jnp.where(live, jnp.asarray(token_loss, jnp.float32), 0.0)
    if mode == "seq-mean-token-mean":
        counts = jnp.sum(live, axis=-1).astype(jnp.float32)
        total = jnp.sum(jnp.sum(values, axis=-1) / jnp.maximum(counts, 1.0))
    else:
        total = jnp.sum(values)
    return total / jnp.asarray(normalizer, jnp.float32)
