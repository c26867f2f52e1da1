"""Generalised advantage estimation over generated tokens, for PPO with a critic
(docs/losses.md#gae-with-a-critic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate

Array = jax.Array


def gae_advantages(
    token_rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Array, Array]:
    """GAE: ``A_t = sum_l (gamma*lam)^l delta_{t+l}``, ``delta_t = r_t + gamma V_{t+1} - V_t``
    (docs/losses.md#gae-with-a-critic, PPO with a critic).

    Masked-out positions (prompt, padding, tool/environment tokens) are skipped:
    the "next" step of a generated token is the next generated token of the same
    sequence, and the sequence ends after its last generated token (V = 0 past
    the end). Rewards and values at masked positions are ignored, so put each
    reward on a generated token (usually the last one).

    Args:
      token_rewards: float ``[B, T]``.
      values: float ``[B, T]``, the critic's value of each position.
      mask: bool/0-1 ``[B, T]``.
      gamma, lam: discount and GAE lambda, in [0, 1].
    Returns:
      (advantages, returns), float32 ``[B, T]``, zero at masked positions;
      ``returns = advantages + values`` on generated tokens (the critic target).

    Example: with ``gamma = lam = 1``, ``A_t`` is the reward-to-go minus ``V_t``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import gae_advantages
      >>> rewards, values = jnp.array([[0.0, 0.0, 1.0]]), jnp.array([[0.2, 0.5, 0.8]])
      >>> adv, ret = gae_advantages(rewards, values, jnp.ones((1, 3)), gamma=1.0, lam=1.0)
      >>> [round(float(a), 4) for a in adv[0]], [round(float(r), 4) for r in ret[0]]
      ([0.8, 0.5, 0.2], [1.0, 1.0, 1.0])
    """
    _validate.check_floating("token_rewards", token_rewards)
    _validate.check_floating("values", values)
    _validate.check_mask("mask", mask)
    _validate.check_rank("token_rewards", token_rewards, 2)
    _validate.check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    _validate.check_interval("gamma", gamma, 0.0, 1.0)
    _validate.check_interval("lam", lam, 0.0, 1.0)
    rewards = jnp.asarray(token_rewards, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    live = jnp.asarray(mask).astype(bool)

    def step(carry, xs):
        next_value, next_adv = carry
        r, v, m = xs
        delta = r + gamma * next_value - v
        adv = delta + gamma * lam * next_adv
        carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
        return carry, jnp.where(m, adv, 0.0)

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, live.T), reverse=True)
    adv = adv_t.T
    returns = jnp.where(live, adv + values, 0.0)
    return adv, returns


def whiten_advantages(advantages: Array, mask: Array, *, eps: float = 1e-8) -> Array:
    """``(A - mean) / sqrt(var + eps)`` over the masked tokens of the whole batch
    (docs/losses.md#gae-with-a-critic; verl's ``masked_whiten``, its default for GAE).

    The mean and the variance run over every masked token of ``advantages`` (the variance with
    Bessel's correction, as verl's; a batch of one token has variance 0). Pass the whole batch,
    never a mini- or micro-batch.

    Args:
      advantages: float ``[B, T]``; mask: bool/0-1 ``[B, T]``; eps: > 0.
    Returns: float32 ``[B, T]``, zero at masked positions.

    Example: the masked tokens ``[1, 2, 3]`` have mean 2 and sample variance 1:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import whiten_advantages
      >>> adv = whiten_advantages(jnp.array([[1.0, 2.0, 3.0, 100.0]]), jnp.array([[1, 1, 1, 0]]))
      >>> [round(float(a), 4) for a in adv[0]]
      [-1.0, 0.0, 1.0, 0.0]
    """
    _validate.check_floating("advantages", advantages)
    _validate.check_mask("mask", mask)
    _validate.check_rank("advantages", advantages, 2)
    _validate.check_same_shape(advantages=advantages, mask=mask)
    _validate.check_positive("eps", eps)
    live = jnp.asarray(mask).astype(bool)
    adv = jnp.where(live, jnp.asarray(advantages, jnp.float32), 0.0)
    count = jnp.sum(live).astype(jnp.float32)
    mean = jnp.sum(adv) / jnp.maximum(count, 1.0)
    var = jnp.sum(jnp.where(live, jnp.square(adv - mean), 0.0)) / jnp.maximum(count - 1.0, 1.0)
    return jnp.where(live, (adv - mean) * jax.lax.rsqrt(var + eps), 0.0)
