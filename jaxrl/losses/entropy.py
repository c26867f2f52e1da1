"""Token logprobs and entropy from logits, entropy bonus, Clip-Cov / KL-Cov, entropy law
(docs/losses.md#entropy-and-its-control).

Shapes: ``B`` sequences of ``T`` positions, vocabulary ``V``.
Every statistic is computed in float32 whatever the input dtype. The model's
chunked LM head computes the same token statistics from hidden states without
ever holding ``[B, T, V]`` logits; the functions here take logits.
"""

from __future__ import annotations

import dataclasses
import fractions

import jax
import jax.numpy as jnp

from jaxrl.losses._validate import (
    check_floating,
    check_integer,
    check_interval,
    check_mask,
    check_ordered,
    check_positive,
    check_rank,
    check_same_shape,
)

__all__ = [
    "token_logprobs_from_logits",
    "token_entropy_from_logits",
    "entropy_bonus",
    "centered_cov",
    "clip_cov_mask",
    "kl_cov_select",
    "kl_cov_gap_penalty",
    "kl_cov_penalty",
    "EntropyLawFit",
    "fit_entropy_law",
]


# --------------------------------------------------------------------------- #
# From logits
# --------------------------------------------------------------------------- #
def token_logprobs_from_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Log-probability of each target token, in float32.

    ``logp[...] = logits[..., y] - logsumexp(logits[...])`` (docs/losses.md#chunked-logprobs-and-entropy).

    Args:
      logits: ``[..., V]`` any float dtype.
      targets: ``[...]`` integer token ids.
    Returns:
      ``[...]`` float32.

    Example: ``log 0.75`` and ``log 0.5``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import token_logprobs_from_logits
      >>> logits = jnp.log(jnp.array([[0.25, 0.75], [0.5, 0.5]]))
      >>> [round(float(x), 4) for x in token_logprobs_from_logits(logits, jnp.array([1, 0]))]
      [-0.2877, -0.6931]
    """
    check_floating("logits", logits)
    check_integer("targets", targets)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets has shape {targets.shape} but logits has shape {logits.shape}; "
            f"expected targets.shape == logits.shape[:-1]"
        )
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def token_entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of the next-token distribution, in float32.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` (docs/losses.md#chunked-logprobs-and-entropy).

    Args:
      logits: ``[..., V]`` any float dtype.
    Returns:
      ``[...]`` float32.

    Example: ``log 2`` for a fair coin, ``-(0.25 log 0.25 + 0.75 log 0.75)``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import token_entropy_from_logits
      >>> logits = jnp.log(jnp.array([[0.5, 0.5], [0.25, 0.75]]))
      >>> [round(float(h), 4) for h in token_entropy_from_logits(logits)]
      [0.6931, 0.5623]
    """
    check_floating("logits", logits)
    z = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(z, axis=-1)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


# --------------------------------------------------------------------------- #
# Entropy bonus and covariance-based entropy control
# --------------------------------------------------------------------------- #
def _check_token_inputs(mask, **arrays):
    for name, x in arrays.items():
        check_floating(name, x)
    check_mask("mask", mask)
    check_rank("mask", mask, 2)
    check_same_shape(mask=mask, **arrays)


def entropy_bonus(entropy: jax.Array, mask: jax.Array, *, coef: float) -> jax.Array:
    """Per-token entropy-bonus loss term ``-coef * H_t`` on masked tokens (docs/losses.md#entropy-bonus).

    Returned per token so the objective aggregates it with the same mode and
    normaliser as the policy loss (independent of the micro-batch split).

    Args:
      entropy: ``[B, T]`` float token entropy (carries gradient).
      mask: ``[B, T]`` bool/0-1, 1 on policy-generated tokens.
      coef: entropy coefficient (>= 0; adding the term to a minimised loss raises entropy).
    Returns:
      ``[B, T]`` float32, zero where ``mask`` is 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import entropy_bonus
      >>> [round(float(x), 4) for x in entropy_bonus(jnp.array([[1.0, 2.0]]), jnp.array([[1, 0]]), coef=0.01)[0]]
      [-0.01, 0.0]
    """
    _check_token_inputs(mask, entropy=entropy)
    check_positive("coef", coef, allow_zero=True)
    return jnp.where(mask.astype(bool), -coef * entropy.astype(jnp.float32), 0.0)


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def centered_cov(logp: jax.Array, advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token centred cross-product ``Cov_i = (logp_i - mean logp)(A_i - mean A)``
    (docs/losses.md#clip-cov-and-kl-cov).

    Means run over the ``N`` masked tokens of the whole batch; ``logp`` is
    detached (the statistic selects tokens, it is not a loss).

    Args:
      logp: ``[B, T]`` float current logprobs.
      advantages: ``[B, T]`` float token advantages.
      mask: ``[B, T]`` bool/0-1.
    Returns:
      ``[B, T]`` float32, zero where ``mask`` is 0.

    Example: masked means ``logp -2``, ``A 0``: ``(1)(1)`` and ``(-1)(-1)``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import centered_cov
      >>> logp, adv, mask = jnp.array([[-1.0, -3.0, 0.0]]), jnp.array([[1.0, -1.0, 5.0]]), jnp.array([[1, 1, 0]])
      >>> [round(float(c), 4) for c in centered_cov(logp, adv, mask)[0]]
      [1.0, 1.0, 0.0]
    """
    _check_token_inputs(mask, logp=logp, advantages=advantages)
    keep = mask.astype(bool)
    logp = jax.lax.stop_gradient(logp).astype(jnp.float32)
    advantages = jax.lax.stop_gradient(advantages).astype(jnp.float32)
    cov = (logp - _masked_mean(logp, keep)) * (advantages - _masked_mean(advantages, keep))
    return jnp.where(keep, cov, 0.0)


def _floor_fraction_of(count: jax.Array, ratio: float) -> jax.Array:
    """``floor(ratio * count)`` exactly, reading ``ratio`` as the decimal it was written as.

    ``2e-4 * 5000`` must give 1, which float32 does not guarantee. With
    ``ratio = p / q`` in lowest terms, ``floor(n p / q) = (n // q) p + ((n % q) p) // q``
    stays inside int32 while ``p q < 2**31`` (any ratio with a few decimals);
    beyond that it falls back to float32.
    """
    frac = fractions.Fraction(repr(float(ratio)))
    p, q = frac.numerator, frac.denominator
    count = count.astype(jnp.int32)
    if p * q < 2**31:
        return (count // q) * p + ((count % q) * p) // q
    return jnp.floor(count.astype(jnp.float32) * ratio).astype(jnp.int32)


def _rank(score: jax.Array) -> jax.Array:
    """Rank of each element of a 1-D array in ascending order (ties by position)."""
    order = jnp.argsort(score, stable=True)
    return jnp.zeros_like(order).at[order].set(jnp.arange(score.shape[0], dtype=order.dtype))


def clip_cov_mask(
    logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    key: jax.Array,
    *,
    ratio: float = 2e-4,
    omega_low: float = 1.0,
    omega_high: float = 5.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clip-Cov: tokens whose policy gradient is detached (docs/losses.md#clip-cov-and-kl-cov).

    Among masked tokens with ``omega_low <= Cov_i <= omega_high`` pick
    ``floor(ratio * N)`` uniformly at random with ``key`` (all of them if fewer
    qualify). The objective zeroes those tokens' policy-gradient term. (verl
    takes ``max(floor(ratio * N), 1)``; docs/losses.md#clip-cov-and-kl-cov says ``floor``.) Compute it once
    on the whole optimizer-step batch and hand the mask to every micro-batch,
    so the choice does not depend on the micro-batch split.

    Args:
      logp: ``[B, T]`` float current logprobs.
      advantages: ``[B, T]`` float token advantages.
      mask: ``[B, T]`` bool/0-1.
      key: a ``jax.random`` key; the same key gives the same selection.
      ratio: fraction of the ``N`` masked tokens to detach, in [0, 1].
      omega_low, omega_high: the covariance band.
    Returns:
      ``(detach [B, T] bool, metrics)``; metrics (scalars): ``clip_cov_count``
      (int32, tokens detached), ``clip_cov_candidates`` (int32, tokens in the
      band), ``clip_cov_fraction`` (float32, count / N).

    Example: ``Cov = [6, 2, 0, 0]``; only token 1 is in ``[1, 5]``, and ``floor(0.25 * 4) = 1``:
      >>> import jax, jax.numpy as jnp
      >>> from jaxrl.losses import clip_cov_mask
      >>> logp, adv = jnp.array([[-1.0, -3.0, -2.0, -2.0]]), jnp.array([[6.0, -2.0, -2.0, -2.0]])
      >>> detach, metrics = clip_cov_mask(logp, adv, jnp.ones((1, 4)), jax.random.PRNGKey(0), ratio=0.25)
      >>> detach.tolist(), int(metrics["clip_cov_candidates"])
      ([[False, True, False, False]], 1)
    """
    cov = centered_cov(logp, advantages, mask)
    check_interval("ratio", ratio, 0.0, 1.0)
    check_ordered("omega_low", omega_low, "omega_high", omega_high)
    keep = mask.astype(bool)
    num_tokens = jnp.sum(keep, dtype=jnp.int32)
    candidate = keep & (cov >= omega_low) & (cov <= omega_high)
    # Uniform draws sort the candidates in a random order; the others go last.
    draw = jax.random.uniform(key, cov.shape)
    rank = _rank(jnp.where(candidate, draw, 2.0).reshape(-1)).reshape(cov.shape)
    detach = candidate & (rank < _floor_fraction_of(num_tokens, ratio))
    count = jnp.sum(detach, dtype=jnp.int32)
    return detach, {
        "clip_cov_count": count,
        "clip_cov_candidates": jnp.sum(candidate, dtype=jnp.int32),
        "clip_cov_fraction": count / jnp.maximum(num_tokens, 1).astype(jnp.float32),
    }


def kl_cov_select(
    logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ratio: float = 2e-3,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL-Cov's tokens: the top ``floor(ratio * N)`` masked tokens by ``Cov_i`` (docs/losses.md#clip-cov-and-kl-cov).

    Selection is deterministic: largest ``Cov_i`` first, ties by position in the
    flattened ``[B, T]`` batch. Select once on the whole optimizer-step batch
    and hand the result to :func:`kl_cov_gap_penalty` per micro-batch, so the
    choice does not depend on the micro-batch split.

    Args:
      logp: ``[B, T]`` float current logprobs (detached here).
      advantages: ``[B, T]`` float token advantages.
      mask: ``[B, T]`` bool/0-1.
      ratio: fraction of the ``N`` masked tokens to select, in [0, 1].
    Returns:
      ``(selected [B, T] bool, metrics)``; metrics: ``kl_cov_count`` (int32),
      ``kl_cov_fraction`` (float32, count / N).

    Example: ``Cov = [6, 2, 0, 0]``, the top ``floor(0.25 * 4) = 1``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_cov_select
      >>> logp, adv = jnp.array([[-1.0, -3.0, -2.0, -2.0]]), jnp.array([[6.0, -2.0, -2.0, -2.0]])
      >>> selected, metrics = kl_cov_select(logp, adv, jnp.ones((1, 4)), ratio=0.25)
      >>> selected.tolist(), float(metrics["kl_cov_fraction"])
      ([[True, False, False, False]], 0.25)
    """
    cov = centered_cov(logp, advantages, mask)
    check_interval("ratio", ratio, 0.0, 1.0)
    keep = mask.astype(bool)
    num_tokens = jnp.sum(keep, dtype=jnp.int32)
    rank = _rank(jnp.where(keep, -cov, jnp.inf).reshape(-1)).reshape(cov.shape)
    selected = keep & (rank < _floor_fraction_of(num_tokens, ratio))
    count = jnp.sum(selected, dtype=jnp.int32)
    return selected, {
        "kl_cov_count": count,
        "kl_cov_fraction": count / jnp.maximum(num_tokens, 1).astype(jnp.float32),
    }


def kl_cov_gap_penalty(
    logp: jax.Array,
    old_logp: jax.Array,
    selected: jax.Array,
    *,
    beta: float = 1.0,
) -> jax.Array:
    """KL-Cov's per-token term ``beta * |logp - old_logp|`` on the ``selected`` tokens
    (docs/losses.md#clip-cov-and-kl-cov).

    The penalty carries gradient through ``logp`` and is added to those tokens'
    per-token loss before aggregation. (verl also drops the PPO clip on the
    selected tokens; docs/losses.md#clip-cov-and-kl-cov only adds the term, so that choice is left to the
    objective.)

    Args:
      logp: ``[B, T]`` float current logprobs (carries gradient).
      old_logp: ``[B, T]`` float logprobs at sampling time (detached here).
      selected: ``[B, T]`` bool/0-1, e.g. from :func:`kl_cov_select` (0 on unmasked tokens).
      beta: penalty coefficient (>= 0).
    Returns:
      ``[B, T]`` float32, zero off ``selected``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_cov_gap_penalty
      >>> logp, old_logp, selected = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.0]]), jnp.array([[True, False]])
      >>> [round(float(x), 4) for x in kl_cov_gap_penalty(logp, old_logp, selected, beta=1.0)[0]]
      [0.5, 0.0]
    """
    check_floating("logp", logp)
    check_floating("old_logp", old_logp)
    check_mask("selected", selected)
    check_same_shape(logp=logp, old_logp=old_logp, selected=selected)
    check_positive("beta", beta, allow_zero=True)
    gap = jnp.abs(logp.astype(jnp.float32) - jax.lax.stop_gradient(old_logp).astype(jnp.float32))
    return jnp.where(selected.astype(bool), beta * gap, 0.0)


def kl_cov_penalty(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ratio: float = 2e-3,
    beta: float = 1.0,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """KL-Cov: ``beta * |logp - old_logp|`` on the top ``floor(ratio * N)`` tokens by ``Cov_i``
    (docs/losses.md#clip-cov-and-kl-cov).

    :func:`kl_cov_select` then :func:`kl_cov_gap_penalty` on the same tokens.

    Args:
      logp: ``[B, T]`` float current logprobs (carries gradient).
      old_logp: ``[B, T]`` float logprobs at sampling time (detached here).
      advantages: ``[B, T]`` float token advantages.
      mask: ``[B, T]`` bool/0-1.
      ratio: fraction of the ``N`` masked tokens to penalise, in [0, 1].
      beta: penalty coefficient (>= 0).
    Returns:
      ``(penalty [B, T] float32, selected [B, T] bool, metrics)``; metrics:
      ``kl_cov_count`` (int32), ``kl_cov_fraction`` (float32, count / N).

    Example: token 0 has the top ``Cov`` (6, as in :func:`kl_cov_select`) and ``|-1 - (-1.5)| = 0.5``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_cov_penalty
      >>> logp, old_logp = jnp.array([[-1.0, -3.0, -2.0, -2.0]]), jnp.array([[-1.5, -3.0, -2.0, -2.0]])
      >>> adv = jnp.array([[6.0, -2.0, -2.0, -2.0]])
      >>> penalty, _, _ = kl_cov_penalty(logp, old_logp, adv, jnp.ones((1, 4)), ratio=0.25)
      >>> [round(float(x), 4) for x in penalty[0]]
      [0.5, 0.0, 0.0, 0.0]
    """
    selected, metrics = kl_cov_select(logp, advantages, mask, ratio=ratio)
    return kl_cov_gap_penalty(logp, old_logp, selected, beta=beta), selected, metrics


# --------------------------------------------------------------------------- #
# Entropy-performance law
# --------------------------------------------------------------------------- #
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EntropyLawFit:
    """Least-squares fit of ``R = -a exp(H) + b`` (docs/losses.md#entropy-performance-law); all float32 scalars.

    ``ceiling = b - a`` is the reward predicted when entropy reaches 0.

    Example: ``R = 1 - 0.1 exp(H)`` exactly, so at ``H = 0`` the ceiling is ``0.9``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import fit_entropy_law
      >>> fit = fit_entropy_law(jnp.log(jnp.array([1.0, 2.0, 3.0])), jnp.array([0.9, 0.8, 0.7]))
      >>> round(float(fit.ceiling), 4)
      0.9
    """

    a: jax.Array
    b: jax.Array
    ceiling: jax.Array
    rmse: jax.Array


def fit_entropy_law(entropy: jax.Array, reward: jax.Array) -> EntropyLawFit:
    """Fits ``R = -a exp(H) + b`` by least squares over training steps (docs/losses.md#entropy-performance-law).

    Ordinary least squares of ``R`` on ``x = exp(H)``: ``a = -cov(x, R) / var(x)``,
    ``b = mean(R) + a mean(x)``, computed on centred values in float32.

    Args:
      entropy: ``[S]`` float mean policy entropy per step (fit on early steps).
      reward: ``[S]`` float mean reward per step.
    Returns:
      :class:`EntropyLawFit` with ``a``, ``b``, ``ceiling = b - a`` and the RMSE
      of the fitted rewards. Needs ``S >= 2`` and entropies that are not all equal
      (otherwise ``a`` is not identified and comes back NaN).

    Example: the points ``exp(H) = [1, 2, 3]``, ``R = [0.9, 0.8, 0.7]`` lie on ``R = -0.1 exp(H) + 1``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import fit_entropy_law
      >>> fit = fit_entropy_law(jnp.log(jnp.array([1.0, 2.0, 3.0])), jnp.array([0.9, 0.8, 0.7]))
      >>> [round(float(x), 4) for x in (fit.a, fit.b, fit.rmse)]
      [0.1, 1.0, 0.0]
    """
    check_rank("entropy", entropy, 1)
    check_floating("entropy", entropy)
    check_floating("reward", reward)
    check_same_shape(entropy=entropy, reward=reward)
    if entropy.shape[0] < 2:
        raise ValueError(
            f"entropy has {entropy.shape[0]} step(s) but at least 2 are needed to fit a and b")
    x = jnp.exp(entropy.astype(jnp.float32))
    r = reward.astype(jnp.float32)
    x_c, r_c = x - jnp.mean(x), r - jnp.mean(r)
    a = -jnp.sum(x_c * r_c) / jnp.sum(x_c * x_c)
    b = jnp.mean(r) + a * jnp.mean(x)
    rmse = jnp.sqrt(jnp.mean((r - (b - a * x)) ** 2))
    return EntropyLawFit(a=a, b=b, ceiling=b - a, rmse=rmse)
