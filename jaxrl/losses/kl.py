"""KL estimators and KL regularisers (docs/losses.md#kl-regularisation, Rethinking-KL).

Notation: ``delta = pi_ref / pi_theta``, ``log_delta = ref_logp - logp``.
Every regulariser is characterised by the detached coefficient ``c`` that
multiplies ``grad log pi_theta`` in its gradient (:func:`kl_coefficient`):

===============  =========================  ===================================
kind             c                          note
===============  =========================  ===================================
"k1-in-reward"   ``log(pi / pi_ref)``       folded into the reward (PPO)
"k2-as-loss"     ``log(pi / pi_ref)``       same gradient on-policy; default
"k3-as-loss"     ``1 - delta``              GRPO; biased first-order surrogate
"k1-as-loss"     ``1``                      zero-mean noise: warns when used
"minimax"        ``pi - pi_ref``            MiniMax-01 MSE, bounded in [-1, 1]
===============  =========================  ===================================

As-loss forms are only correct on-policy; :func:`kl_off_policy_token_loss`
applies appendix G's correction. Everything is float32 and elementwise over
``[B, T]`` tokens (``vmap``-free: broadcasting does it).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate
from jaxrl.losses import policy

Array = jax.Array

KL_REGULARIZERS = ("k1-in-reward", "k2-as-loss", "k3-as-loss", "k1-as-loss", "minimax")
AS_LOSS_KINDS = ("k2-as-loss", "k3-as-loss", "k1-as-loss", "minimax")
K1_AS_LOSS_WARNING = (
    "KL kind 'k1-as-loss' does not regularise: its gradient is independent of ref_logp and has "
    "zero mean under the sampling policy, so it only adds noise (Rethinking-KL section 5); "
    "use 'k2-as-loss' or 'k1-in-reward'"
)


def _log_delta(logp: Array, ref_logp: Array) -> Array:
    _validate.check_floating("logp", logp)
    _validate.check_floating("ref_logp", ref_logp)
    _validate.check_same_shape(logp=logp, ref_logp=ref_logp)
    return jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32)


def kl_k1(logp: Array, ref_logp: Array) -> Array:
    """``k1 = -log_delta = logp - ref_logp`` (docs/losses.md#kl-value-estimators): unbiased, can be negative.
    Float ``[...]`` -> float32 ``[...]``."""
    return -_log_delta(logp, ref_logp)


def kl_k2(logp: Array, ref_logp: Array) -> Array:
    """``k2 = 0.5 * log_delta**2`` (docs/losses.md#kl-value-estimators): biased, low variance.
    Float ``[...]`` -> float32 ``[...]``."""
    return 0.5 * _log_delta(logp, ref_logp) ** 2


def kl_k3(logp: Array, ref_logp: Array) -> Array:
    """``k3 = delta - 1 - log_delta`` (docs/losses.md#kl-value-estimators): unbiased, >= 0, infinite variance when
    pi_ref is much wider. Float ``[...]`` -> float32 ``[...]``."""
    log_delta = _log_delta(logp, ref_logp)
    return jnp.expm1(log_delta) - log_delta


def kl_coefficient(kind: str, logp: Array, ref_logp: Array) -> Array:
    """Detached ``c = d k_n / d log pi`` at the snapshot ``logp``; MiniMax ``c = pi - pi_ref``
    (docs/losses.md#kl-regularisers, appendix G eq. 71).

    Args: kind in ``KL_REGULARIZERS``; logp, ref_logp float ``[...]`` (same shape).
    Returns: float32 ``[...]``, with no gradient.
    """
    _validate.check_choice("kind", kind, KL_REGULARIZERS)
    log_delta = jax.lax.stop_gradient(_log_delta(logp, ref_logp))
    if kind in ("k1-in-reward", "k2-as-loss"):
        return -log_delta
    if kind == "k3-as-loss":
        return -jnp.expm1(log_delta)
    if kind == "k1-as-loss":
        return jnp.ones_like(log_delta)
    logp32 = jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
    return jnp.exp(logp32) - jnp.exp(jnp.asarray(ref_logp, jnp.float32))


def kl_as_loss(kind: str, logp: Array, ref_logp: Array, mask: Array) -> Array:
    """Per-token as-loss term ``k_n(pi_theta, pi_ref)`` to add (times a coefficient) to the loss
    (docs/losses.md#kl-regularisers).

    * "k2-as-loss": ``0.5 (logp - ref_logp)^2``; "k3-as-loss": ``k3``;
      "k1-as-loss": ``logp - ref_logp`` (emits a ``UserWarning``: it does not
      regularise); "minimax": value ``0.5 (pi - pi_ref)^2`` with the gradient
      of the MiniMax-01 Monte-Carlo surrogate ``sg(pi - pi_ref) log pi``
      (appendix eq. 67: the full-vocabulary MSE's gradient in expectation).
    Only correct for on-policy samples; see :func:`kl_off_policy_token_loss`.

    Args: kind in ``AS_LOSS_KINDS``; logp float ``[B, T]`` (carries gradient);
      ref_logp float ``[B, T]``; mask ``[B, T]``.
    Returns: float32 ``[B, T]``, 0 on masked tokens; its gradient with respect
      to ``logp`` is ``kl_coefficient(kind, ...)``.
    """
    if kind == "k1-in-reward":
        raise ValueError(
            "kind='k1-in-reward' is not a loss term: fold it into the rewards with kl_in_reward "
            f"before computing advantages; as-loss kinds are {list(AS_LOSS_KINDS)}"
        )
    _validate.check_choice("kind", kind, AS_LOSS_KINDS)
    _validate.check_mask("mask", mask)
    _validate.check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    live = jnp.asarray(mask).astype(bool)
    # Masked tokens are replaced before any nonlinearity so that a junk value
    # there (inf, nan) cannot reach the gradient.
    logp32 = jnp.where(live, jnp.asarray(logp, jnp.float32), 0.0)
    ref32 = jnp.where(live, jnp.asarray(ref_logp, jnp.float32), 0.0)
    if kind == "k2-as-loss":
        term = kl_k2(logp32, ref32)
    elif kind == "k3-as-loss":
        term = kl_k3(logp32, ref32)
    elif kind == "k1-as-loss":
        warnings.warn(K1_AS_LOSS_WARNING, stacklevel=2)
        term = kl_k1(logp32, ref32)
    else:
        diff = kl_coefficient("minimax", logp32, ref32)
        term = 0.5 * diff**2 + diff * (logp32 - jax.lax.stop_gradient(logp32))
    return jnp.where(live, term, 0.0)


def kl_in_reward(rewards: Array, sample_logp: Array, ref_logp: Array, mask: Array, *, coef: float) -> Array:
    """k1 in reward: ``r - coef * k1`` with ``k1 = sample_logp - ref_logp``, detached
    (docs/losses.md#kl-in-reward-versus-kl-as-loss, PPO's combined form).

    Fold the penalty into the rewards *before* computing advantages. Use the
    log-probabilities of the sampling policy (``old_logp``, or ``rollout_logp``
    when bypassing): the penalty is part of the reward, not of the gradient.

    Args:
      rewards: float ``[B, T]`` token rewards (the penalty lands on each
        masked token), or ``[B]`` sequence rewards (minus ``coef`` times the
        masked sum of k1 over the sequence).
      sample_logp, ref_logp: float ``[B, T]``; mask ``[B, T]``; coef >= 0.
    Returns: float32, shape of ``rewards``, with no gradient.
    """
    _validate.check_floating("rewards", rewards)
    _validate.check_mask("mask", mask)
    _validate.check_rank("sample_logp", sample_logp, 2)
    _validate.check_same_shape(sample_logp=sample_logp, ref_logp=ref_logp, mask=mask)
    _validate.check_positive("coef", coef, allow_zero=True)
    live = jnp.asarray(mask).astype(bool)
    penalty = jnp.where(live, coef * kl_k1(sample_logp, ref_logp), 0.0)
    rewards32 = jnp.asarray(rewards, jnp.float32)
    if rewards32.ndim == 2:
        _validate.check_same_shape(rewards=rewards, mask=mask)
        shaped = rewards32 - penalty
    else:
        _validate.check_rank("rewards", rewards, (1, 2))
        if rewards32.shape[0] != jnp.shape(mask)[0]:
            raise ValueError(
                f"rewards has shape {rewards32.shape} but mask has {jnp.shape(mask)[0]} rows; "
                "expected one sequence reward per row ([B]) or token rewards shaped like mask ([B, T])"
            )
        shaped = rewards32 - jnp.sum(penalty, axis=-1)
    return jax.lax.stop_gradient(shaped)


def kl_off_policy_token_loss(
    kind: str,
    logp: Array,
    old_logp: Array,
    ref_logp: Array,
    mask: Array,
    *,
    policy_loss: str = "ppo",
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Off-policy KL: ``-min(rho (-c'), clip(rho) (-c'))`` with ``c' = sg(d k_n / d log pi)`` at the current snapshot
    (docs/losses.md#off-policy-kl-correction, appendix G eq. 70-71).

    The as-loss term is converted to its in-reward head (the detached
    coefficient :func:`kl_coefficient` evaluated at ``sg(logp)``, the snapshot
    the gradient is taken at) and sent through the same importance ratio and
    clip as the reward term: ``policy_loss`` with advantage ``-c'``. At ratio 1
    its gradient equals the on-policy as-loss gradient ``c' grad log pi``.
    The coefficient differs from token to token, so "gspo" runs as
    "gspo-token" here: the same sequence ratio and clip, with each token's
    gradient through its own log-probability.

    Args: kind in ``KL_REGULARIZERS`` (k1-in-reward gives k2's coefficient);
      logp float ``[B, T]`` (carries gradient); old_logp, ref_logp float
      ``[B, T]``; mask ``[B, T]``; policy_loss, eps_low, eps_high, dual_clip:
      as the reward term's (see :func:`jaxrl.losses.policy.policy_token_loss`).
    Returns: (float32 ``[B, T]`` token loss, 0 on masked tokens; the policy
      loss's clip metrics for this head).
    """
    _validate.check_same_shape(logp=logp, old_logp=old_logp, ref_logp=ref_logp, mask=mask)
    if kind == "k1-as-loss":
        warnings.warn(K1_AS_LOSS_WARNING, stacklevel=2)
    live = jnp.asarray(mask).astype(bool)
    coefficient = kl_coefficient(kind, jnp.where(live, logp, 0.0), jnp.where(live, ref_logp, 0.0))
    policy_loss = "gspo-token" if policy_loss == "gspo" else policy_loss
    return policy.policy_token_loss(
        policy_loss, logp, old_logp, -coefficient, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip
    )
