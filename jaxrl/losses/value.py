"""The critic's loss and its fit: PPO's clipped value loss and the explained variance
(docs/losses.md#gae-with-a-critic).

Both take next-token aligned ``[B, T]`` arrays like the policy losses: ``values[b, t]`` is the
critic's value of the state before the token that column ``t`` scores, ``returns`` its GAE
target (``jaxrl.losses.gae``), ``mask`` 1 on generated tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate

Array = jax.Array


def _check_values(mask, **arrays) -> None:
    for name, x in arrays.items():
        _validate.check_floating(name, x)
        _validate.check_rank(name, x, 2)
    _validate.check_mask("mask", mask)
    _validate.check_same_shape(**arrays, mask=mask)


def clipped_value_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
                       clip: float | None = 0.2) -> tuple[Array, dict[str, Array]]:
    """PPO's clipped value loss per token (docs/losses.md#gae-with-a-critic; PPO, arXiv 1707.06347,
    as in OpenAI baselines ``ppo2``, verl ``compute_value_loss`` and OpenRLHF ``ValueLoss``):

        l_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2)

    The clipped term keeps the critic from moving its value of a token more than ``c`` away
    from the value it had when the batch was scored, unless that brings it closer to the
    return; ``clip=None`` is the plain squared error ``0.5 * (V_t - R_t)^2``.

    Args:
      values: float ``[B, T]``, the critic's current values (the only input with gradient).
      old_values: float ``[B, T]``, the values when the batch was scored (constant).
      returns: float ``[B, T]``, the targets (constant), e.g. GAE returns.
      mask: bool/0-1 ``[B, T]``, 1 on tokens that enter the loss.
      clip: ``c > 0``, or None for no clipping.
    Returns:
      (token loss float32 ``[B, T]``, 0 at masked positions; aggregate it with
      ``aggregate_loss``), metrics over the masked tokens: ``vf_clip_frac`` (the fraction
      where the clipped term is the larger one, i.e. the clip decides the gradient),
      ``values_mean``, ``value_error`` (mean |V - R|).

    Example: token 1 is clipped to ``0.5 + 0.2``, ``0.5 * (0.7 - 2)^2 = 0.845``; token 2 is
    inside the clip, ``0.5 * 0.6^2 = 0.18``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import clipped_value_loss
      >>> values, old, ret = jnp.array([[1.0, 0.6]]), jnp.array([[0.5, 0.5]]), jnp.array([[2.0, 0.0]])
      >>> loss, metrics = clipped_value_loss(values, old, ret, jnp.ones((1, 2)), clip=0.2)
      >>> [round(float(x), 4) for x in loss[0]], float(metrics["vf_clip_frac"])
      ([0.845, 0.18], 0.5)
    """
    _check_values(mask, values=values, old_values=old_values, returns=returns)
    if clip is not None:
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
            raise ValueError(f"clip={clip!r} but a finite value > 0 (or None for no clipping) was expected")
    live = jnp.asarray(mask).astype(bool)
    v = jnp.asarray(values, jnp.float32)
    old = jax.lax.stop_gradient(jnp.asarray(old_values, jnp.float32))
    ret = jax.lax.stop_gradient(jnp.asarray(returns, jnp.float32))
    # Masked positions may hold junk (inf, NaN): replace them before any arithmetic so that no
    # NaN reaches the gradient through jnp.where's untaken branch.
    v, old, ret = (jnp.where(live, x, 0.0) for x in (v, old, ret))
    unclipped = jnp.square(v - ret)
    if clip is None:
        token_loss, clipped_larger = 0.5 * unclipped, jnp.zeros_like(live)
    else:
        clipped = jnp.square(jnp.clip(v, old - clip, old + clip) - ret)
        token_loss = 0.5 * jnp.maximum(unclipped, clipped)
        clipped_larger = clipped > unclipped
    token_loss = jnp.where(live, token_loss, 0.0)
    count = jnp.maximum(jnp.sum(live), 1).astype(jnp.float32)

    def mean(x):
        return jnp.sum(jnp.where(live, x, 0.0).astype(jnp.float32)) / count

    metrics = {"vf_clip_frac": mean(clipped_larger), "values_mean": jax.lax.stop_gradient(mean(v)),
               "value_error": jax.lax.stop_gradient(mean(jnp.abs(v - ret)))}
    return token_loss, metrics


def explained_variance(returns: Array, values: Array, mask: Array) -> Array:
    """How much of the returns' variance the values explain (docs/losses.md#gae-with-a-critic):

        EV = 1 - Var(R - V) / Var(R)

    over the masked tokens (population variances; the ratio is the same with Bessel's
    correction). 1 is a perfect critic, 0 one no better than the mean return, negative one
    worse than that. Conventions at the edges (as scikit-learn's ``explained_variance_score``):
    when ``Var(R) = 0`` it is 1 if ``Var(R - V)`` is 0 too and 0 otherwise; with no masked
    token it is 0.

    Args:
      returns, values: float ``[B, T]``; mask: bool/0-1 ``[B, T]``.
    Returns: float32 scalar, no gradient.

    Example: ``Var([1, 2, 3]) = 2/3``, ``Var(R - V) = Var([0, 0, 1]) = 2/9``, ``EV = 1 - 1/3``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import explained_variance
      >>> ev = explained_variance(jnp.array([[1.0, 2.0, 3.0]]), jnp.array([[1.0, 2.0, 2.0]]), jnp.ones((1, 3)))
      >>> round(float(ev), 4)
      0.6667
    """
    _check_values(mask, returns=returns, values=values)
    live = jnp.asarray(mask).astype(bool)
    ret = jnp.where(live, jnp.asarray(returns, jnp.float32), 0.0)
    err = jnp.where(live, ret - jnp.asarray(values, jnp.float32), 0.0)
    count = jnp.sum(live).astype(jnp.float32)

    def variance(x):
        mean = jnp.sum(x) / jnp.maximum(count, 1.0)
        return jnp.sum(jnp.where(live, jnp.square(x - mean), 0.0)) / jnp.maximum(count, 1.0)

    var_returns, var_error = variance(ret), variance(err)
    ev = jnp.where(var_returns > 0, 1.0 - var_error / jnp.where(var_returns > 0, var_returns, 1.0),
                   jnp.where(var_error > 0, 0.0, 1.0))
    return jax.lax.stop_gradient(jnp.where(count > 0, ev, 0.0).astype(jnp.float32))
