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
"abs-as-loss"    ``sign(log(pi / pi_ref))`` verl "abs"; 0 where pi = pi_ref
"k3+-as-loss"    ``log(pi / pi_ref)``       verl "k3+": k3's value, k2's gradient
===============  =========================  ===================================

The k3 kinds take an optional ``clamp`` (verl's low_var_kl clamp, off by
default). As-loss forms are only correct on-policy;
:func:`kl_off_policy_token_loss` applies appendix G's correction. Everything
is float32 and elementwise over ``[B, T]`` tokens (``vmap``-free:
broadcasting does it).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate
from jaxrl.losses import policy

Array = jax.Array

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


def _k3(log_delta: Array, clamp: float | None) -> Array:
    """``delta - 1 - log_delta``, optionally clipped to ``[-clamp, clamp]`` with zero gradient outside."""
    if clamp is None:
        return jnp.expm1(log_delta) - log_delta
    value = jax.lax.stop_gradient(jnp.expm1(log_delta) - log_delta)
    inside = jnp.abs(value) <= clamp  # inclusive, as torch.clamp's gradient
    # Outliers are replaced before expm1: their zero gradient must not meet an
    # overflowed exp (0 * inf = nan), and jnp.clip would give 1/2 at the edge.
    safe = jnp.where(inside, log_delta, 0.0)
    return jnp.where(inside, jnp.expm1(safe) - safe, jnp.clip(value, -clamp, clamp))


def _check_clamp(clamp: float | None, kind: str | None = None) -> None:
    if clamp is None:
        return
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float)):
        raise ValueError(f"clamp={clamp!r} but a number > 0 (verl uses 10.0) or None was expected")
    _validate.check_positive("clamp", clamp)
    if kind is not None and kind not in CLAMP_KINDS:
        raise ValueError(f"clamp={clamp!r} applies only to kind in {list(CLAMP_KINDS)} but kind={kind!r}; "
                         "pass clamp=None")


def kl_k1(logp: Array, ref_logp: Array) -> Array:
    """``k1 = -log_delta = logp - ref_logp`` (docs/losses.md#kl-value-estimators): unbiased, can be negative.
    Float ``[...]`` -> float32 ``[...]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_k1
      >>> [round(float(k), 4) for k in kl_k1(jnp.array([-1.0, -1.5]), jnp.array([-1.5, -1.0]))]
      [0.5, -0.5]
    """
    return -_log_delta(logp, ref_logp)


def kl_k2(logp: Array, ref_logp: Array) -> Array:
    """``k2 = 0.5 * log_delta**2`` (docs/losses.md#kl-value-estimators): biased, low variance.
    Float ``[...]`` -> float32 ``[...]``.

    Example: ``0.5 * 0.5^2``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_k2
      >>> round(float(kl_k2(jnp.array(-1.0), jnp.array(-1.5))), 4)
      0.125
    """
    return 0.5 * _log_delta(logp, ref_logp) ** 2


def kl_k3(logp: Array, ref_logp: Array, *, clamp: float | None = None) -> Array:
    """``k3 = delta - 1 - log_delta`` (docs/losses.md#kl-value-estimators): unbiased, >= 0, infinite variance when
    pi_ref is much wider. Float ``[...]`` -> float32 ``[...]``.

    ``clamp``: clip k3 to ``[-clamp, clamp]`` (verl ``kl_penalty_forward``'s
    "low_var_kl" clamps to [-10, 10]); tokens outside get zero gradient. Off
    by default: clipping biases the estimate low (k3 is unbiased only
    unclipped) and silences exactly the outlier tokens that are furthest from
    the reference, which a regulariser should pull hardest. verl clamps "for
    numerical stability" (bf16 log-probabilities, where ``exp`` of a large
    ``log_delta`` overflows early); this float32 ``expm1`` overflows only for
    ``pi_ref / pi > e^88``. With a clamp, such tokens get the value ``clamp``
    and a zero (finite) gradient.

    Example: ``log_delta = -0.5``, ``k3 = exp(-0.5) - 1 + 0.5``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_k3
      >>> round(float(kl_k3(jnp.array(-1.0), jnp.array(-1.5))), 4)
      0.1065
    """
    _check_clamp(clamp)
    return _k3(_log_delta(logp, ref_logp), clamp)


def kl_abs(logp: Array, ref_logp: Array) -> Array:
    """``|logp - ref_logp| = |log_delta|`` (verl ``kl_penalty_forward`` "abs"): biased upwards, >= 0.
    Float ``[...]`` -> float32 ``[...]``.

    Its gradient with respect to ``logp`` is ``sign(logp - ref_logp)``, 0
    where they are equal (as torch's ``abs``; ``jnp.abs`` would give 1 there,
    which at initialisation, policy = reference, pushes every token down).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_abs
      >>> [round(float(k), 4) for k in kl_abs(jnp.array([-1.0, -1.5]), jnp.array([-1.5, -1.0]))]
      [0.5, 0.5]
    """
    k1 = -_log_delta(logp, ref_logp)
    return k1 * jnp.sign(jax.lax.stop_gradient(k1))


# Per-kind (coefficient, as-loss term or None for an in-reward kind). Each takes
# float32 ``logp`` (may carry gradient), ``ref_logp`` and ``clamp``, validated
# and with masked tokens already replaced; the coefficient gets ``sg(logp)``.
def _c_log_ratio(logp, ref, clamp):
    return logp - ref


def _c_k3(logp, ref, clamp):
    log_delta = ref - logp
    c = -jnp.expm1(log_delta)
    if clamp is None:
        return c
    return jnp.where(jnp.abs(jnp.expm1(log_delta) - log_delta) <= clamp, c, 0.0)


def _c_one(logp, ref, clamp):
    return jnp.ones_like(logp)


def _c_minimax(logp, ref, clamp):
    return jnp.exp(logp) - jnp.exp(ref)


def _c_sign(logp, ref, clamp):
    return jnp.sign(logp - ref)


def _term_k2(logp, ref, clamp):
    return kl_k2(logp, ref)


def _term_k3(logp, ref, clamp):
    return _k3(ref - logp, clamp)


def _term_k1(logp, ref, clamp):
    warnings.warn(K1_AS_LOSS_WARNING, stacklevel=3)  # the caller of kl_as_loss
    return kl_k1(logp, ref)


def _term_minimax(logp, ref, clamp):
    # Value 0.5 (pi - pi_ref)^2, gradient sg(pi - pi_ref) grad log pi (appendix eq. 67).
    diff = _c_minimax(jax.lax.stop_gradient(logp), ref, clamp)
    return 0.5 * diff**2 + diff * (logp - jax.lax.stop_gradient(logp))


def _term_abs(logp, ref, clamp):
    return kl_abs(logp, ref)


def _term_k3_plus(logp, ref, clamp):
    # Straight-through (verl kl_penalty with a "+" kind): k2 + sg(k3 - k2).
    k2 = kl_k2(logp, ref)
    return k2 + jax.lax.stop_gradient(_k3(ref - logp, clamp) - k2)


_KINDS = {
    "k1-in-reward": (_c_log_ratio, None),
    "k2-as-loss": (_c_log_ratio, _term_k2),
    "k3-as-loss": (_c_k3, _term_k3),
    "k1-as-loss": (_c_one, _term_k1),
    "minimax": (_c_minimax, _term_minimax),
    "abs-as-loss": (_c_sign, _term_abs),
    "k3+-as-loss": (_c_log_ratio, _term_k3_plus),
}
KL_REGULARIZERS = tuple(_KINDS)
AS_LOSS_KINDS = tuple(kind for kind, (_, term) in _KINDS.items() if term is not None)
CLAMP_KINDS = ("k3-as-loss", "k3+-as-loss")  # the kinds whose value is k3, which take ``clamp``


def kl_coefficient(kind: str, logp: Array, ref_logp: Array, *, clamp: float | None = None) -> Array:
    """Detached ``c = d k_n / d log pi`` at the snapshot ``logp``; MiniMax ``c = pi - pi_ref``
    (docs/losses.md#kl-regularisers, appendix G eq. 71).

    Args: kind in ``KL_REGULARIZERS``; logp, ref_logp float ``[...]`` (same shape);
      clamp: k3's clip (only for kinds in ``CLAMP_KINDS``): "k3-as-loss"'s
      coefficient is 0 where ``|k3| > clamp``; "k3+-as-loss" has k2's
      coefficient whatever the clamp.
    Returns: float32 ``[...]``, with no gradient.

    Example: ``log(pi / pi_ref) = 0.5``: k2's ``c = 0.5``, k3's ``c = 1 - exp(-0.5)``, k1's ``c = 1``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_coefficient
      >>> logp, ref_logp = jnp.array(-1.0), jnp.array(-1.5)
      >>> [round(float(kl_coefficient(k, logp, ref_logp)), 4) for k in ("k2-as-loss", "k3-as-loss", "k1-as-loss")]
      [0.5, 0.3935, 1.0]
    """
    _validate.check_choice("kind", kind, KL_REGULARIZERS)
    _check_clamp(clamp, kind)
    _log_delta(logp, ref_logp)  # validation
    coefficient, _ = _KINDS[kind]
    logp32 = jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
    ref32 = jax.lax.stop_gradient(jnp.asarray(ref_logp, jnp.float32))
    return coefficient(logp32, ref32, clamp)


def kl_as_loss(kind: str, logp: Array, ref_logp: Array, mask: Array, *, clamp: float | None = None) -> Array:
    """Per-token as-loss term ``k_n(pi_theta, pi_ref)`` to add (times a coefficient) to the loss
    (docs/losses.md#kl-regularisers).

    * "k2-as-loss": ``0.5 (logp - ref_logp)^2``; "k3-as-loss": ``k3``;
      "k1-as-loss": ``logp - ref_logp`` (emits a ``UserWarning``: it does not
      regularise); "minimax": value ``0.5 (pi - pi_ref)^2`` with the gradient
      of the MiniMax-01 Monte-Carlo surrogate ``sg(pi - pi_ref) log pi``
      (appendix eq. 67: the full-vocabulary MSE's gradient in expectation);
      "abs-as-loss": ``|logp - ref_logp|`` (verl "abs"), gradient
      ``sign(logp - ref_logp)``; "k3+-as-loss": ``k2 + sg(k3 - k2)``, the
      value of k3 with the gradient of k2 (verl ``kl_penalty`` "k3+", the
      straight-through form).
    Only correct for on-policy samples; see :func:`kl_off_policy_token_loss`.

    Args: kind in ``AS_LOSS_KINDS``; logp float ``[B, T]`` (carries gradient);
      ref_logp float ``[B, T]``; mask ``[B, T]``; clamp: clip k3's value to
      ``[-clamp, clamp]`` for the kinds in ``CLAMP_KINDS`` (verl's 10; off by
      default, see :func:`kl_k3`).
    Returns: float32 ``[B, T]``, 0 on masked tokens; its gradient with respect
      to ``logp`` is ``kl_coefficient(kind, ..., clamp=clamp)``.

    Example: "k3-as-loss" at ``log_delta = -0.5``: value ``exp(-0.5) - 0.5``, gradient ``1 - exp(-0.5)``:
      >>> import jax, jax.numpy as jnp
      >>> from jaxrl.losses import kl_as_loss
      >>> logp, ref_logp, mask = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, 0.0]]), jnp.array([[1, 0]])
      >>> term = lambda lp: kl_as_loss("k3-as-loss", lp, ref_logp, mask)
      >>> grad = jax.grad(lambda lp: term(lp).sum())(logp)
      >>> [round(float(x), 4) for x in term(logp)[0]], [round(float(g), 4) for g in grad[0]]
      ([0.1065, 0.0], [0.3935, 0.0])
    """
    if kind == "k1-in-reward":
        raise ValueError(
            "kind='k1-in-reward' is not a loss term: fold it into the rewards with kl_in_reward "
            f"before computing advantages; as-loss kinds are {list(AS_LOSS_KINDS)}"
        )
    _validate.check_choice("kind", kind, AS_LOSS_KINDS)
    _check_clamp(clamp, kind)
    _validate.check_mask("mask", mask)
    _validate.check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    live = jnp.asarray(mask).astype(bool)
    # Masked tokens are replaced before any nonlinearity so that a junk value
    # there (inf, nan) cannot reach the gradient.
    logp32 = jnp.where(live, jnp.asarray(logp, jnp.float32), 0.0)
    ref32 = jnp.where(live, jnp.asarray(ref_logp, jnp.float32), 0.0)
    _, term = _KINDS[kind]
    return jnp.where(live, term(logp32, ref32, clamp), 0.0)


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

    Example: ``k1 = [0.5, 1.0]``, ``coef = 0.1``; a sequence reward loses ``0.1 * 1.5``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import kl_in_reward
      >>> logp, ref_logp, mask = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.5, -2.0]]), jnp.ones((1, 2))
      >>> [round(float(r), 4) for r in kl_in_reward(jnp.array([1.0]), logp, ref_logp, mask, coef=0.1)]
      [0.85]
      >>> [round(float(r), 4) for r in kl_in_reward(jnp.array([[0.0, 1.0]]), logp, ref_logp, mask, coef=0.1)[0]]
      [-0.05, 0.9]
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
    clamp: float | None = None,
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
      as the reward term's (see :func:`jaxrl.losses.policy.policy_token_loss`);
      clamp: k3's clip for the kinds in ``CLAMP_KINDS`` (see :func:`kl_coefficient`).
    Returns: (float32 ``[B, T]`` token loss, 0 on masked tokens; the policy
      loss's clip metrics for this head).

    Example: "k2-as-loss" at ratio 1 (``logp = old_logp``): ``c' = logp - ref_logp = 0.5``, and the loss
    ``-rho * (-c')`` has value and gradient ``c'``:
      >>> import jax, jax.numpy as jnp
      >>> from jaxrl.losses import kl_off_policy_token_loss
      >>> logp, ref_logp, mask = jnp.array([[-1.0]]), jnp.array([[-1.5]]), jnp.ones((1, 1))
      >>> f = lambda lp: kl_off_policy_token_loss("k2-as-loss", lp, logp, ref_logp, mask, eps_low=0.2, eps_high=0.28)
      >>> round(float(f(logp)[0].sum()), 4), round(float(jax.grad(lambda lp: f(lp)[0].sum())(logp)[0, 0]), 4)
      (0.5, 0.5)
    """
    _validate.check_same_shape(logp=logp, old_logp=old_logp, ref_logp=ref_logp, mask=mask)
    if kind == "k1-as-loss":
        warnings.warn(K1_AS_LOSS_WARNING, stacklevel=2)
    live = jnp.asarray(mask).astype(bool)
    coefficient = kl_coefficient(kind, jnp.where(live, logp, 0.0), jnp.where(live, ref_logp, 0.0), clamp=clamp)
    policy_loss = "gspo-token" if policy_loss == "gspo" else policy_loss
    return policy.policy_token_loss(
        policy_loss, logp, old_logp, -coefficient, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip
    )
