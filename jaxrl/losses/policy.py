"""Policy-gradient surrogate losses (docs/losses.md#policy-losses).

All token losses take ``[B, T]`` arrays (``B`` sequences, ``T`` positions),
return a ``[B, T]`` float32 loss that is zero on masked-out tokens plus a dict
of metrics, and compute ratios in log space, exponentiating last. A masked-out
token's ``logp``, ``old_logp`` or advantage never reaches a loss value, a
gradient or a metric.

``jaxrl.losses.aggregation`` reduces them to a scalar, dividing by a normaliser computed
once on the *global* batch so that summing the losses of micro-batches gives the
full-batch loss and gradient whatever the split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate

Array = jax.Array



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
    float32 ``[B, T]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import masked_log_ratio
      >>> masked_log_ratio(jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -2.0]]), jnp.array([[1, 0]])).tolist()
      [[0.5, 0.0]]
    """
    live = jnp.asarray(mask).astype(bool)
    diff = jnp.asarray(logp, jnp.float32) - jnp.asarray(old_logp, jnp.float32)
    return jnp.where(live, diff, 0.0)


def gspo_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    """GSPO ``log s_i = mean_t(logp - old_logp)`` over masked tokens (docs/losses.md#gspo-and-gspo-token).

    Args: ``logp``, ``old_logp`` float ``[B, T]``; ``mask`` ``[B, T]``.
    Returns: float32 ``[B]``; 0 for a sequence without masked tokens.

    Example: the masked log ratios 0.2 and 0.4 average to 0.3:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import gspo_log_ratio
      >>> logp, old_logp = jnp.array([[-1.0, -2.0, 0.0]]), jnp.array([[-1.2, -2.4, 5.0]])
      >>> [round(float(s), 4) for s in gspo_log_ratio(logp, old_logp, jnp.array([[1, 1, 0]]))]
      [0.3]
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
    return loss, _ratio_metrics(live, ratio, clipped_high=clipped_high, clipped_low=clipped_low,
                                dual_clipped=dual_clipped)


def _ratio_metrics(live, ratio, *, clipped_high=None, clipped_low=None, dual_clipped=None):
    """Detached masked means over this call's tokens: the clip fractions given (``clip_frac`` is their
    union) and ``ratio_mean``, ``ratio_max`` of ``ratio`` (0 on masked tokens)."""
    n = jnp.maximum(jnp.sum(live), 1).astype(jnp.float32)
    metrics = {}
    fractions = {"clip_frac_high": clipped_high, "clip_frac_low": clipped_low, "dual_clip_frac": dual_clipped}
    fractions = {name: live & flags for name, flags in fractions.items() if flags is not None}
    for name, flags in fractions.items():
        metrics[name] = jnp.sum(flags) / n
    if fractions:
        metrics["clip_frac"] = jnp.sum(functools.reduce(jnp.logical_or, fractions.values())) / n
    ratio_live = jnp.where(live, jax.lax.stop_gradient(ratio), 0.0)
    metrics["ratio_mean"] = jnp.sum(ratio_live) / n
    metrics["ratio_max"] = jnp.max(ratio_live)
    return metrics


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

    Example: ``A = 1``, ``rho = exp(0.1)`` is inside the clip, ``exp(0.3)`` is clipped at 1.28:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import ppo_clip_token_loss
      >>> logp, old_logp, adv = jnp.array([[-0.9, -0.7]]), jnp.array([[-1.0, -1.0]]), jnp.ones((1, 2))
      >>> loss, metrics = ppo_clip_token_loss(logp, old_logp, adv, jnp.ones((1, 2)), eps_low=0.2, eps_high=0.28)
      >>> [round(float(x), 4) for x in loss[0]], float(metrics["clip_frac_high"])
      ([-1.1052, -1.28], 0.5)
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

    Example: ``s = exp(mean(0.1, 0.3)) = exp(0.2)``, clipped at ``1 + 4e-4`` for ``A = 1``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import gspo_token_loss
      >>> logp, old_logp, adv = jnp.array([[-0.9, -0.7]]), jnp.array([[-1.0, -1.0]]), jnp.ones((1, 2))
      >>> loss, metrics = gspo_token_loss(logp, old_logp, adv, jnp.ones((1, 2)))
      >>> [round(float(x), 4) for x in loss[0]], float(metrics["clip_frac"])
      ([-1.0004, -1.0004], 1.0)
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


def cispo_token_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> tuple[Array, dict[str, Array]]:
    """CISPO ``-sg(clip(rho, 1-eps_low, 1+eps_high)) A log pi`` (docs/losses.md#cispo; MiniMax-M1,
    arXiv 2506.13585).

    REINFORCE with a clipped, detached importance weight: with
    ``rho_t = exp(logp_t - old_logp_t)``,
    ``l_t = -sg[clip(rho_t, 1-eps_low, 1+eps_high)] * A_t * logp_t``, so
    ``d l_t / d logp_t = -clip(rho_t) A_t`` for every token: a clipped token keeps
    its gradient (at the bound's weight), unlike PPO where it loses it.

    Clip bounds: two-sided ``[1-eps_low, 1+eps_high]`` for every sign of ``A``,
    as verl's ``compute_policy_loss_cispo``. The paper clips only from above (it
    sets the lower epsilon "to a large value"); that is ``eps_low=1.0`` (lower
    bound 0), this function's default. ``eps_high=0.28`` is this library's
    clip-higher default, not a value from the paper (which only says it tuned
    eps_high). Through ``policy_token_loss`` the caller's eps are used (the
    trainer's default 0.2 / 0.28 clips two-sided).

    Args: as :func:`ppo_clip_token_loss`, without ``dual_clip`` (CISPO has none).
    Returns: token loss float32 ``[B, T]`` (0 on masked tokens); metrics over
      masked tokens: ``clip_frac_high`` (rho > 1+eps_high, any sign of A),
      ``clip_frac_low`` (rho < 1-eps_low), ``clip_frac`` (either: the tokens whose
      weight is clipped; their gradient is not zero), ``ratio_mean``,
      ``ratio_max`` (of the unclipped rho).

    Example: ``A = 1``: ``-exp(0.1) * -0.9`` and ``-1.28 * -0.7`` (``exp(0.3)`` clipped at 1.28):
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import cispo_token_loss
      >>> logp, old_logp, adv = jnp.array([[-0.9, -0.7]]), jnp.array([[-1.0, -1.0]]), jnp.ones((1, 2))
      >>> loss, metrics = cispo_token_loss(logp, old_logp, adv, jnp.ones((1, 2)))
      >>> [round(float(x), 4) for x in loss[0]], float(metrics["clip_frac_high"])
      ([0.9947, 0.896], 0.5)
    """
    _check_token_inputs(logp, old_logp, advantages, mask)
    _check_clip_args(eps_low, eps_high, None)
    live = jnp.asarray(mask).astype(bool)
    adv = jnp.where(live, jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32)), 0.0)
    logp32 = jnp.where(live, jnp.asarray(logp, jnp.float32), 0.0)
    ratio = jnp.exp(masked_log_ratio(jax.lax.stop_gradient(logp32), jax.lax.stop_gradient(old_logp), mask))
    weight = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.where(live, -weight * adv * logp32, 0.0)
    return loss, _ratio_metrics(live, ratio, clipped_high=ratio > 1.0 + eps_high, clipped_low=ratio < 1.0 - eps_low)


def gmpo_token_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
) -> tuple[Array, dict[str, Array]]:
    """GMPO ``-A_i * prod_t(clipped rho_{i,t})^(1/|y_i|)``, the geometric mean of token ratios clipped
    token by token in log space (docs/losses.md#gmpo; Geometric-Mean Policy Optimization, arXiv 2507.20673).

    With ``l_t = logp_t - old_logp_t`` and ``sgn = sign(A_t)``, each token's log
    ratio is clipped PPO-style on the side the advantage's sign makes binding,
    ``c_t = sgn * min(sgn * l_t, sgn * clip(l_t, -eps_low, eps_high))`` (0 where
    ``A_t = 0``), and the sequence ratio is
    ``s_i = exp(sum_t m_t c_t / sum_t m_t)``. The eps are LOG-space bounds: the
    ratio range is ``(exp(-eps_low), exp(eps_high))``; the paper's is
    ``(e^-0.4, e^0.4)``, this function's default.

    Spreading to tokens: every masked token of sequence ``i`` carries the full
    sequence loss ``-A_t s_i``, written as
    ``l_t = -A_t * sg[s_i] * exp(c_t - sg[c_t])`` (value ``-A_t s_i``, gradient
    through the token's own ``c_t``, the GSPO-token device). With a per-sequence
    advantage broadcast to tokens, ``"seq-mean-token-mean"`` aggregation gives
    exactly the paper's objective ``(1/G) sum_i -A_i s_i`` and its gradient
    ``-A_i s_i / |y_i|`` per unclipped token (verl's ``compute_policy_loss_geo_mean``,
    which averages over the micro-batch's sequences; here the global sequence
    count of ``aggregation.loss_normalizer`` divides). Other modes weight sequences by
    their length. Token-varying advantages: the value under seq-mean-token-mean
    is verl's (which uses the sequence mean of ``A``), but each token's gradient
    carries its own ``A_t`` (verl supports only sequence advantages).

    Args: as :func:`ppo_clip_token_loss`, eps in log space (>= 0), without
      ``dual_clip`` (GMPO has none).
    Returns: token loss float32 ``[B, T]`` (0 on masked tokens); metrics over
      masked tokens: ``clip_frac_high`` (A>0, l_t > eps_high), ``clip_frac_low``
      (A<0, l_t < -eps_low), ``clip_frac`` (either: the tokens with zero
      gradient), ``ratio_mean``, ``ratio_max`` (of ``s_i`` on each masked token,
      as GSPO's).

    Example: ``A = 1``, log ratios ``[0.1, 0.6]``, the second clipped to 0.4: ``s = exp(0.25)``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import gmpo_token_loss
      >>> logp, old_logp, adv = jnp.array([[-0.9, -0.4]]), jnp.array([[-1.0, -1.0]]), jnp.ones((1, 2))
      >>> loss, metrics = gmpo_token_loss(logp, old_logp, adv, jnp.ones((1, 2)))
      >>> [round(float(x), 4) for x in loss[0]], float(metrics["clip_frac_high"])
      ([-1.284, -1.284], 0.5)
    """
    _check_token_inputs(logp, old_logp, advantages, mask)
    _validate.check_positive("eps_low", eps_low, allow_zero=True)
    _validate.check_positive("eps_high", eps_high, allow_zero=True)
    live = jnp.asarray(mask).astype(bool)
    adv = jnp.where(live, jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32)), 0.0)
    log_ratio = masked_log_ratio(logp, jax.lax.stop_gradient(old_logp), mask)
    sign = jnp.sign(adv)
    chosen = sign * jnp.minimum(sign * log_ratio, sign * jnp.clip(log_ratio, -eps_low, eps_high))
    counts = jnp.sum(live, axis=-1, keepdims=True).astype(jnp.float32)
    seq_ratio = jnp.exp(jnp.sum(chosen, axis=-1, keepdims=True) / jnp.maximum(counts, 1.0))
    own = jnp.exp(chosen - jax.lax.stop_gradient(chosen))
    loss = jnp.where(live, -adv * jax.lax.stop_gradient(seq_ratio) * own, 0.0)
    metrics = _ratio_metrics(live, jnp.broadcast_to(seq_ratio, jnp.shape(log_ratio)),
                             clipped_high=(adv > 0) & (log_ratio > eps_high),
                             clipped_low=(adv < 0) & (log_ratio < -eps_low))
    return loss, metrics


def reinforce_token_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
) -> tuple[Array, dict[str, Array]]:
    """REINFORCE ``-sg(A) log pi`` (docs/losses.md#reinforce-and-gpg; Williams 1992; GPG, arXiv 2504.02546).

    ``l_t = -sg[A_t] * logp_t``: no ratio, no clip, so ``d l_t / d logp_t = -A_t``.
    This is also GPG's token loss (Group Policy Gradient, arXiv 2504.02546, and
    verl's ``compute_policy_loss_gpg``: ``-log_prob * advantages``); what sets GPG
    apart is how it estimates the advantage (a group baseline and the paper's
    bias correction), an advantage-estimator matter, so the loss is not
    registered under a second name.
    The gradient is the on-policy one whatever ``old_logp``: use it with one
    optimizer step per batch, or accept the bias of stale samples.

    Args: ``logp``, ``old_logp``, ``advantages``, ``mask`` as :func:`ppo_clip_token_loss`
      (no clip, so no eps and no dual clip). ``old_logp`` only feeds the metrics.
    Returns: token loss float32 ``[B, T]`` (0 on masked tokens); metrics over
      masked tokens: ``ratio_mean``, ``ratio_max`` of ``rho = exp(logp - old_logp)``
      (how far the policy has moved; nothing is clipped).

    Example: ``-A * logp`` token by token:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import reinforce_token_loss
      >>> logp, adv = jnp.array([[-0.5, -2.0]]), jnp.array([[2.0, -1.0]])
      >>> loss, _ = reinforce_token_loss(logp, logp, adv, jnp.ones((1, 2)))
      >>> [round(float(x), 4) for x in loss[0]]
      [1.0, -2.0]
    """
    _check_token_inputs(logp, old_logp, advantages, mask)
    live = jnp.asarray(mask).astype(bool)
    adv = jnp.where(live, jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32)), 0.0)
    logp32 = jnp.where(live, jnp.asarray(logp, jnp.float32), 0.0)
    loss = jnp.where(live, -adv * logp32, 0.0)
    ratio = jnp.exp(masked_log_ratio(logp, old_logp, mask))
    return loss, _ratio_metrics(live, ratio)


def sapo_token_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Array, dict[str, Array]]:
    """SAPO ``-f(rho) A`` with the soft gate ``f(x) = sigmoid(tau (x - 1)) * 4 / tau`` in place of the clip
    (docs/losses.md#sapo; Soft Adaptive Policy Optimization, arXiv 2511.20347).

    ``rho_t = exp(logp_t - old_logp_t)``, ``tau_t = tau_pos`` if ``A_t > 0`` else
    ``tau_neg``, ``l_t = -A_t * sigmoid(tau_t (rho_t - 1)) * 4 / tau_t``, so
    ``d l_t / d logp_t = -A_t * 4 sigma (1 - sigma) rho_t``: ``-A_t`` on policy
    (``rho = 1``) and decaying smoothly as ``rho`` leaves 1, faster for larger
    ``tau`` (hence ``tau_neg > tau_pos``: negative updates are damped harder).
    Defaults are the paper's and verl's (``tau_pos=1.0``, ``tau_neg=1.05``);
    :func:`policy_token_loss` uses them. The paper's objective averages tokens
    within a sequence, then sequences: "seq-mean-token-mean" aggregation, as verl.

    Args: ``logp``, ``old_logp``, ``advantages``, ``mask`` as :func:`ppo_clip_token_loss`
      (the gate replaces the clip: no eps, no dual clip); ``tau_pos``, ``tau_neg`` > 0.
    Returns: token loss float32 ``[B, T]`` (0 on masked tokens); metrics over
      masked tokens: ``ratio_mean``, ``ratio_max`` (nothing is clipped).

    Example: on policy (``rho = 1``) the gate is ``sigmoid(0) * 4 / tau = 2 / tau``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import sapo_token_loss
      >>> logp, adv = jnp.array([[-1.0, -1.0]]), jnp.array([[1.0, -1.0]])
      >>> loss, _ = sapo_token_loss(logp, logp, adv, jnp.ones((1, 2)))
      >>> [round(float(x), 4) for x in loss[0]]  # -2 / 1.0, 2 / 1.05
      [-2.0, 1.9048]
    """
    _check_token_inputs(logp, old_logp, advantages, mask)
    _validate.check_positive("tau_pos", tau_pos)
    _validate.check_positive("tau_neg", tau_neg)
    live = jnp.asarray(mask).astype(bool)
    adv = jnp.where(live, jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32)), 0.0)
    ratio = jnp.exp(masked_log_ratio(logp, jax.lax.stop_gradient(old_logp), mask))
    tau = jnp.where(adv > 0, jnp.float32(tau_pos), jnp.float32(tau_neg))
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = jnp.where(live, -adv * gate, 0.0)
    return loss, _ratio_metrics(live, ratio)


# Policy loss name -> (its token loss, the clip options it takes), called as ``fn(logp, old_logp,
# advantages, mask, **{option: value})``; the one declaration of the policy-loss choices (as the
# mismatch corrections' ``objective._CORRECTIONS``).
_CLIP = ("eps_low", "eps_high")
POLICY_LOSSES = {
    "ppo": (ppo_clip_token_loss, _CLIP + ("dual_clip",)),
    "gspo": (gspo_token_loss, _CLIP + ("dual_clip",)),
    "gspo-token": (functools.partial(gspo_token_loss, token_gradient=True), _CLIP + ("dual_clip",)),
    "cispo": (cispo_token_loss, _CLIP),
    "gmpo": (gmpo_token_loss, _CLIP),
    "reinforce": (reinforce_token_loss, ()),  # also GPG's token loss (see its docstring)
    "sapo": (sapo_token_loss, ()),  # tau_pos=1.0, tau_neg=1.05 (the paper's)
}
# The kinds that honour ``dual_clip``; the others raise ValueError when it is set.
DUAL_CLIP_LOSSES = tuple(kind for kind, (_, options) in POLICY_LOSSES.items() if "dual_clip" in options)


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
    """Dispatches ``kind`` in ``POLICY_LOSSES`` ("ppo", "gspo", "gspo-token", "cispo", "gmpo", "reinforce",
    "sapo") to its token loss with the options it takes (docs/losses.md#policy-losses).

    Shapes as :func:`ppo_clip_token_loss`. "reinforce" and "sapo" have no clip: the eps are not
    theirs and are not passed. ``dual_clip`` must be None unless ``kind`` is in
    ``DUAL_CLIP_LOSSES`` (ValueError naming both).

    Example: "ppo" with ``A = 1`` and ``rho = exp(0.3)`` clipped at ``1 + eps_high = 1.2``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import policy_token_loss
      >>> logp, old_logp, adv, mask = jnp.array([[-0.7]]), jnp.array([[-1.0]]), jnp.ones((1, 1)), jnp.ones((1, 1))
      >>> loss, _ = policy_token_loss("ppo", logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.2)
      >>> round(float(loss[0, 0]), 4)
      -1.2
    """
    _validate.check_choice("kind", kind, POLICY_LOSSES)
    loss, options = POLICY_LOSSES[kind]
    if dual_clip is not None and "dual_clip" not in options:
        raise ValueError(f"dual_clip={dual_clip!r} but the {kind} policy loss has no dual clip; pass dual_clip=None "
                         f"(dual_clip applies to the policy losses {list(DUAL_CLIP_LOSSES)})")
    given = {"eps_low": eps_low, "eps_high": eps_high, "dual_clip": dual_clip}
    return loss(logp, old_logp, advantages, mask, **{option: given[option] for option in options})
