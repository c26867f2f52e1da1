"""The full RL objective from a typed config: the one function the trainer calls.

``rl_objective`` composes, per micro-batch,

    loss = agg(w * pg_t [+ kl_cov_t]) + kl_coef * agg(kl_t) + agg(-entropy_coef * H_t)

where ``pg_t`` is the policy surrogate (PPO / GSPO / GSPO-token, docs/losses.md#policy-losses) with Clip-Cov's
tokens detached (docs/losses.md#clip-cov-and-kl-cov), ``w`` the detached mismatch correction
(docs/losses.md#mismatch-corrections), ``kl_t`` the KL regulariser (docs/losses.md#kl-regularisers; as-loss
kinds go through the appendix-G off-policy form by default), and every ``agg`` the same aggregation mode and
global normaliser (docs/losses.md#policy-losses), so that summing the losses of the micro-batches of one batch
gives the full-batch loss and gradient. Clip-Cov and KL-Cov choose tokens from whole-batch statistics: with
micro-batches, call :func:`entropy_control_selection` once on the optimizer step's whole batch and pass each
micro-batch its rows of the result as ``cov_selection``; the sum is then the full-batch loss too.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate, aggregation, corrections, entropy as entropy_lib, kl as kl_lib, mismatch, policy

Array = jax.Array

# Mismatch correction (docs/losses.md#mismatch-corrections) ->
# (its function in ``corrections``, {keyword: ObjectiveConfig field}).
# "icepop" is token MIS under the name of the Ring-1T paper: the same two-sided band.
_TOKEN_MIS = (corrections.token_mis, {"c_low": "mis_c_low", "c_high": "mis_c_high"})
_CORRECTIONS = {
    "token-tis": (corrections.token_tis, {"cap": "tis_cap"}),
    "seq-tis": (corrections.sequence_tis, {"cap": "tis_cap"}),
    "token-mis": _TOKEN_MIS,
    "icepop": _TOKEN_MIS,
    "seq-mis": (corrections.sequence_mis, {"cap": "seq_mis_cap", "lower": "seq_mis_lower"}),
    "geo-rs": (corrections.geo_rs, {"lower": "geo_rs_lower", "upper": "geo_rs_upper"}),
    "seq-kl-rs": (corrections.sequence_kl_rs, {"estimator": "seq_kl_rs_estimator", "aggregate": "seq_kl_rs_aggregate",
                                               "threshold": "seq_kl_rs_threshold"}),
}
# The IS-weight corrections and the level their batch normalisation averages at; the other
# corrections are rejections, which can be combined with one of these (``mismatch_rejection``).
_IS_LEVELS = {"token-tis": "token", "seq-tis": "sequence"}

# The values ObjectiveConfig accepts, from the registries ("none": the term is off).
# Entropy controls are dispatched in entropy_control_selection and rl_objective.
KL_KINDS = ("none",) + kl_lib.KL_REGULARIZERS
ENTROPY_CONTROLS = ("none", "clip-cov", "kl-cov")
MISMATCH_CORRECTIONS = ("none",) + tuple(_CORRECTIONS)
MISMATCH_REJECTIONS = ("none",) + tuple(name for name in _CORRECTIONS if name not in _IS_LEVELS)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """What :func:`rl_objective` computes. Validated on construction; errors name the field.

    Fields (defaults in brackets):
      policy_loss ["ppo"]: one of ``policy.POLICY_LOSSES``: "ppo" | "gspo" | "gspo-token" | "cispo" |
        "gmpo" | "reinforce" | "sapo" (docs/losses.md#policy-losses).
      eps_low, eps_high [0.2, 0.28]: clip range (DAPO clip-higher); GSPO wants
        ~3e-4 / 4e-4, GMPO's are log-space bounds (paper 0.4 / 0.4), "reinforce" and "sapo"
        ignore them. dual_clip [None]: c > 1 for A < 0, for the kinds in ``policy.DUAL_CLIP_LOSSES``.
      aggregation ["token-mean"]: one of ``aggregation.AGGREGATION_MODES``; the caller computes
        ``normalizer`` with ``losses.loss_normalizer`` on the global batch for this mode.
      kl_kind ["none"], kl_coef [0.0]: KL regulariser (docs/losses.md#kl-regularisers). "k1-in-reward"
        adds nothing to the loss: fold it into the rewards with ``losses.kl_in_reward`` before the
        advantages (see ``kl_in_reward_coef``). "k1-as-loss" is allowed but warns.
      kl_off_policy_correction [True]: send as-loss kinds through the policy
        ratio and clip (appendix G); False uses the plain on-policy as-loss.
      entropy_coef [0.0]: entropy bonus ``-coef * H`` (needs ``entropy``).
      entropy_control ["none"]: "clip-cov" (clip_cov_ratio 2e-4, clip_cov_omega_low 1, clip_cov_omega_high 5;
        needs ``key``) or "kl-cov" (kl_cov_ratio 2e-3, kl_cov_beta 1) (docs/losses.md#clip-cov-and-kl-cov defaults).
      mismatch_correction ["none"]: "token-tis" / "seq-tis" (cap ``tis_cap`` 2),
        "token-mis" = "icepop" (band [1/mis_c_low, mis_c_high] = [0.5, 5]),
        "seq-mis" (cap ``seq_mis_cap`` 2, optional lower bound ``seq_mis_lower``), "geo-rs" ([geo_rs_lower,
        geo_rs_upper] = [0.95, 1.05], wider than verl's [0.999, 1.001] so short responses are not all
        rejected; docs/losses.md#the-geo-rs-band), "seq-kl-rs" (a sequence's ``seq_kl_rs_aggregate`` ["mean"] of
        ``seq_kl_rs_estimator`` ["k3"] above ``seq_kl_rs_threshold`` [0.01])
        (docs/losses.md#mismatch-corrections); needs ``rollout_logp``.
      mismatch_rejection ["none"]: a rejection (any correction but the TIS ones) applied together
        with a "token-tis" / "seq-tis" ``mismatch_correction``: the weight is the IS weight on the
        tokens both keep. is_batch_normalize [False]: divide the IS weight by its mean over the
        mini-batch (token mean for token-tis, mean of sequence means for seq-tis).
      kl_clamp [None]: clamp k3 to [-kl_clamp, kl_clamp] for "k3-as-loss" / "k3+-as-loss" as
        verl's low_var_kl does (10); off by default: it biases the estimate and silences outliers.
      bypass [False]: use ``rollout_logp`` as ``old_logp`` (Ring-Linear eq. 5); excludes a mismatch
        correction and the batch filter (no learner/rollout ratio is left).
      batch_filter_threshold [None]: report ``batch_filter_skip`` when ``batch_filter_metric``
        ["mismatch_k3"] exceeds it; the trainer skips the optimizer step (a zero loss is not a skip under Adam).

    Example:
      >>> from jaxrl.losses import ObjectiveConfig
      >>> ObjectiveConfig(kl_kind="k1-in-reward", kl_coef=0.05).kl_in_reward_coef, ObjectiveConfig().kl_in_reward_coef
      (0.05, 0.0)
    """

    policy_loss: Literal["ppo", "gspo", "gspo-token", "cispo", "gmpo", "reinforce", "sapo"] = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                         "seq-mean-token-sum-norm"] = "token-mean"
    kl_kind: Literal["none", "k1-in-reward", "k2-as-loss", "k3-as-loss", "k1-as-loss", "minimax", "abs-as-loss",
                     "k3+-as-loss"] = "none"
    kl_coef: float = 0.0
    kl_clamp: float | None = None
    kl_off_policy_correction: bool = True
    entropy_coef: float = 0.0
    entropy_control: Literal["none", "clip-cov", "kl-cov"] = "none"
    clip_cov_ratio: float = 2e-4
    clip_cov_omega_low: float = 1.0
    clip_cov_omega_high: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_beta: float = 1.0
    mismatch_correction: Literal["none", "token-tis", "seq-tis", "token-mis", "icepop", "seq-mis", "geo-rs",
                                 "seq-kl-rs"] = "none"
    mismatch_rejection: Literal["none", "token-mis", "icepop", "seq-mis", "geo-rs", "seq-kl-rs"] = "none"
    is_batch_normalize: bool = False
    tis_cap: float = 2.0
    mis_c_low: float = 2.0
    mis_c_high: float = 5.0
    seq_mis_cap: float = 2.0
    seq_mis_lower: float | None = None
    geo_rs_lower: float = 0.95
    geo_rs_upper: float = 1.05
    seq_kl_rs_estimator: Literal["k2", "k3"] = "k3"
    seq_kl_rs_aggregate: Literal["sum", "mean", "max"] = "mean"
    seq_kl_rs_threshold: float = 0.01
    bypass: bool = False
    batch_filter_threshold: float | None = None
    batch_filter_metric: str = "mismatch_k3"

    def __post_init__(self):
        key = lambda field: f"ObjectiveConfig.{field}"  # noqa: E731
        _validate.check_choice(key("policy_loss"), self.policy_loss, policy.POLICY_LOSSES)
        _validate.check_choice(key("aggregation"), self.aggregation, aggregation.AGGREGATION_MODES)
        _validate.check_choice(key("kl_kind"), self.kl_kind, KL_KINDS)
        _validate.check_choice(key("entropy_control"), self.entropy_control, ENTROPY_CONTROLS)
        _validate.check_choice(key("mismatch_correction"), self.mismatch_correction, MISMATCH_CORRECTIONS)
        _validate.check_choice(key("mismatch_rejection"), self.mismatch_rejection, MISMATCH_REJECTIONS)
        _validate.check_choice(key("seq_kl_rs_estimator"), self.seq_kl_rs_estimator, corrections.KL_RS_ESTIMATORS)
        _validate.check_choice(key("seq_kl_rs_aggregate"), self.seq_kl_rs_aggregate, corrections.KL_RS_AGGREGATES)
        _validate.check_choice(key("batch_filter_metric"), self.batch_filter_metric, mismatch.BATCH_FILTER_METRICS)
        for name in ("kl_off_policy_correction", "bypass", "is_batch_normalize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{key(name)}={getattr(self, name)!r} but a bool (true/false) was expected")
        numbers = [f.name for f in dataclasses.fields(self) if f.type in ("float", "float | None")]
        for name in numbers:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{key(name)}={value!r} but a number was expected")
        _validate.check_interval(key("eps_low"), self.eps_low, 0.0, 1.0)
        for name in ("eps_high", "kl_coef", "entropy_coef", "kl_cov_beta"):
            _validate.check_positive(key(name), getattr(self, name), allow_zero=True)
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"{key('dual_clip')}={self.dual_clip!r} but a value > 1 (e.g. 3.0) or None was expected")
        if self.dual_clip is not None and self.policy_loss not in policy.DUAL_CLIP_LOSSES:
            raise ValueError(f"{key('dual_clip')}={self.dual_clip!r} but {key('policy_loss')}={self.policy_loss!r} "
                             f"has no dual clip; set dual_clip to None or use one of {list(policy.DUAL_CLIP_LOSSES)}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            _validate.check_interval(key(name), getattr(self, name), 0.0, 1.0)
        _validate.check_ordered(key("clip_cov_omega_low"), self.clip_cov_omega_low,
                                key("clip_cov_omega_high"), self.clip_cov_omega_high)
        for name in ("tis_cap", "mis_c_low", "mis_c_high", "seq_mis_cap", "geo_rs_lower"):
            _validate.check_positive(key(name), getattr(self, name))
        _validate.check_ordered(key("1/mis_c_low"), 1.0 / self.mis_c_low, key("mis_c_high"), self.mis_c_high)
        _validate.check_ordered(key("geo_rs_lower"), self.geo_rs_lower, key("geo_rs_upper"), self.geo_rs_upper)
        if self.seq_mis_lower is not None:
            _validate.check_positive(key("seq_mis_lower"), self.seq_mis_lower)
            _validate.check_ordered(key("seq_mis_lower"), self.seq_mis_lower, key("seq_mis_cap"), self.seq_mis_cap)
        _validate.check_positive(key("seq_kl_rs_threshold"), self.seq_kl_rs_threshold, allow_zero=True)
        if self.mismatch_rejection != "none" and self.mismatch_correction not in _IS_LEVELS:
            raise ValueError(
                f"{key('mismatch_rejection')}={self.mismatch_rejection!r} combines a rejection with an IS weight, but "
                f"{key('mismatch_correction')}={self.mismatch_correction!r} is not one; set mismatch_correction to "
                f"one of {list(_IS_LEVELS)}, or put the rejection alone in mismatch_correction")
        if self.is_batch_normalize and self.mismatch_correction not in _IS_LEVELS:
            raise ValueError(f"{key('is_batch_normalize')}=True normalises an IS weight, but "
                             f"{key('mismatch_correction')}={self.mismatch_correction!r} is not one of "
                             f"{list(_IS_LEVELS)}")
        if self.kl_clamp is not None:
            _validate.check_positive(key("kl_clamp"), self.kl_clamp)
            if self.kl_kind not in kl_lib.CLAMP_KINDS:
                raise ValueError(f"{key('kl_clamp')}={self.kl_clamp} clamps k3, but {key('kl_kind')}={self.kl_kind!r}; "
                                 f"use one of {list(kl_lib.CLAMP_KINDS)} or set kl_clamp to None")
        if self.batch_filter_threshold is not None:
            _validate.check_positive(key("batch_filter_threshold"), self.batch_filter_threshold, allow_zero=True)
        if self.bypass and (self.mismatch_correction != "none" or self.mismatch_rejection != "none"
                            or self.batch_filter_threshold is not None):
            raise ValueError(
                f"{key('bypass')}=True uses rollout_logp as old_logp, so "
                f"{key('mismatch_correction')}={self.mismatch_correction!r} and "
                f"{key('batch_filter_threshold')}={self.batch_filter_threshold!r} have no ratio to "
                "correct or filter; turn bypass off or set them to 'none' / None"
            )
        if self.kl_kind == "none" and self.kl_coef > 0:
            raise ValueError(f"{key('kl_coef')}={self.kl_coef} but {key('kl_kind')}='none'; choose a kl_kind "
                             f"from {list(kl_lib.KL_REGULARIZERS)} or set kl_coef to 0")
        if self.kl_kind == "k1-as-loss":
            warnings.warn(kl_lib.K1_AS_LOSS_WARNING, stacklevel=3)

    @property
    def kl_in_reward_coef(self) -> float:
        """The coefficient the trainer passes to ``losses.kl_in_reward`` (0 unless kl_kind is "k1-in-reward")."""
        return self.kl_coef if self.kl_kind == "k1-in-reward" else 0.0


def _masked_mean(x: Array, mask: Array) -> Array:
    live = jnp.asarray(mask).astype(bool)
    return jnp.sum(jnp.where(live, jax.lax.stop_gradient(x).astype(jnp.float32), 0.0)) / jnp.maximum(jnp.sum(live), 1)


def _correction(config: ObjectiveConfig, name: str, old_logp, rollout_logp, mask):
    """``(weight, keep, metrics)`` of the correction ``name`` with the config's options for it."""
    correct, options = _CORRECTIONS[name]
    return correct(old_logp, rollout_logp, mask,
                   **{keyword: getattr(config, field) for keyword, field in options.items()})


def active_rejections(config: ObjectiveConfig) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """The rejections ``config`` applies, each as ``(its ObjectiveConfig field, its name, the metric
    of the fraction of masked tokens it drops, the ObjectiveConfig fields of its band)``: the
    correction when it is a rejection, and ``mismatch_rejection``. The IS weights drop nothing."""
    applied = [("mismatch_correction", config.mismatch_correction), ("mismatch_rejection", config.mismatch_rejection)]
    out = []
    for field, name in applied:
        if name == "none" or name in _IS_LEVELS:
            continue
        correct, options = _CORRECTIONS[name]
        out.append((field, name, corrections.REJECTED_TOKEN_FRACTION[correct], tuple(options.values())))
    return out


def is_batch_mean(config: ObjectiveConfig, old_logp: Array, rollout_logp: Array, mask: Array) -> Array:
    """The mean IS weight ``is_batch_normalize`` divides by, over the tokens given: call it on the
    optimizer step's whole batch and pass it to each micro-batch's :func:`rl_objective` as
    ``is_batch_mean``, so the normalisation does not depend on the split.

    Example: token-TIS weights ``[exp(0), min(exp(1), 2)] = [1, 2]`` have mean 1.5:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import ObjectiveConfig, is_batch_mean
      >>> config = ObjectiveConfig(mismatch_correction="token-tis", is_batch_normalize=True)
      >>> float(is_batch_mean(config, jnp.array([[-1.0, -0.5]]), jnp.array([[-1.0, -1.5]]), jnp.ones((1, 2))))
      1.5
    """
    weight, _, _ = _correction(config, config.mismatch_correction, old_logp, rollout_logp, mask)
    level = _IS_LEVELS[config.mismatch_correction]
    return corrections.batch_normalize_is_weights(weight, mask, level=level)[1]["is_batch_norm_factor"]


def _mismatch_weight(config: ObjectiveConfig, old_logp, rollout_logp, mask, batch_mean):
    """Detached per-token weight of the policy term and the corrections' metrics
    (docs/losses.md#mismatch-corrections): the correction's weight, batch-normalised when asked
    (over the loss mask, before any rejection, as verl), then times the rejection's keep."""
    weight, keep, metrics = _correction(config, config.mismatch_correction, old_logp, rollout_logp, mask)
    if config.is_batch_normalize:
        weight, normalized = corrections.batch_normalize_is_weights(
            weight, mask, level=_IS_LEVELS[config.mismatch_correction], batch_mean=batch_mean)
        metrics = {**metrics, **normalized}
    if config.mismatch_rejection != "none":
        rejection = _correction(config, config.mismatch_rejection, old_logp, rollout_logp, mask)
        weight, keep, metrics = corrections.combine_corrections((weight, keep, metrics), rejection)
    return jax.lax.stop_gradient(weight), metrics


def _require(name: str, value, why: str) -> None:
    if value is None:
        raise ValueError(f"{name} is None but {why}; pass a [B, T] float array")


def entropy_control_selection(
    config: ObjectiveConfig,
    logp: Array,
    advantages: Array,
    mask: Array,
    *,
    key: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Clip-Cov's detached tokens or KL-Cov's penalised tokens over all masked tokens given
    (docs/losses.md#clip-cov-and-kl-cov).

    Call it on the optimizer step's whole batch (with the ``logp`` of the parameters being
    differentiated) and pass the rows of each micro-batch to :func:`rl_objective` as ``cov_selection``.

    Args:
      config: an :class:`ObjectiveConfig` with ``entropy_control`` "clip-cov" or "kl-cov".
      logp: float ``[B, T]`` current log-probabilities (detached here).
      advantages: float ``[B, T]`` token advantages.
      mask: ``[B, T]`` 1 on generated tokens.
      key: ``jax.random`` key; needed by "clip-cov".
    Returns:
      ``(selection [B, T] bool, metrics)``: ``clip_cov_count``, ``clip_cov_candidates``,
      ``clip_cov_fraction`` or ``kl_cov_count``, ``kl_cov_fraction`` (over the ``N`` tokens).

    Example: KL-Cov's top ``floor(0.25 * 4) = 1`` token by ``Cov = [6, 2, 0, 0]``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import ObjectiveConfig, entropy_control_selection
      >>> logp, adv = jnp.array([[-1.0, -3.0, -2.0, -2.0]]), jnp.array([[6.0, -2.0, -2.0, -2.0]])
      >>> config = ObjectiveConfig(entropy_control="kl-cov", kl_cov_ratio=0.25)
      >>> entropy_control_selection(config, logp, adv, jnp.ones((1, 4)))[0].tolist()
      [[True, False, False, False]]
    """
    if config.entropy_control == "clip-cov":
        if key is None:
            raise ValueError("key is None but ObjectiveConfig.entropy_control='clip-cov' selects tokens at "
                             "random; pass a jax.random key (e.g. jax.random.fold_in(seed_key, step))")
        return entropy_lib.clip_cov_mask(
            logp, advantages, mask, key, ratio=config.clip_cov_ratio,
            omega_low=config.clip_cov_omega_low, omega_high=config.clip_cov_omega_high)
    if config.entropy_control == "kl-cov":
        return entropy_lib.kl_cov_select(logp, advantages, mask, ratio=config.kl_cov_ratio)
    raise ValueError(f"ObjectiveConfig.entropy_control={config.entropy_control!r} selects no tokens; "
                     "call entropy_control_selection only with 'clip-cov' or 'kl-cov'")


def rl_objective(
    config: ObjectiveConfig,
    logp: Array,
    old_logp: Array | None,
    advantages: Array,
    mask: Array,
    *,
    rollout_logp: Array | None = None,
    ref_logp: Array | None = None,
    entropy: Array | None = None,
    normalizer: Array | float,
    key: Array | None = None,
    cov_selection: Array | None = None,
    is_batch_mean: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """``loss = agg(w * pg [+ kl_cov]) + kl_coef * agg(kl) - entropy_coef * agg(H)``
    (docs/losses.md#the-rl-objective, module docstring).

    Args:
      config: an :class:`ObjectiveConfig`.
      logp: float ``[B, T]`` current log-probabilities of the sampled tokens (carries gradient).
      old_logp: float ``[B, T]`` learner log-probabilities at sampling time; may be None with ``bypass``.
      advantages: float ``[B, T]`` (broadcast sequence advantages with ``losses.broadcast_to_tokens``).
      mask: ``[B, T]`` 1 on generated tokens.
      rollout_logp: float ``[B, T]`` rollout-engine log-probabilities; needed by bypass, corrections, batch filter.
      ref_logp: float ``[B, T]`` reference log-probabilities; needed by as-loss KL kinds.
      entropy: float ``[B, T]`` token entropy (carries gradient); needed when ``entropy_coef > 0``.
      normalizer: scalar from ``losses.loss_normalizer(config.aggregation, global_mask)``.
      key: ``jax.random`` key; needed by "clip-cov" without ``cov_selection``.
      cov_selection: ``[B, T]`` bool, this call's rows of :func:`entropy_control_selection` on the whole
        optimizer-step batch (Clip-Cov's detached / KL-Cov's penalised tokens). None: selected from
        this call's tokens, which is the same thing only when the call sees the whole batch.
      is_batch_mean: with ``is_batch_normalize``, :func:`is_batch_mean` of the whole optimizer-step
        batch; None: this call's own mean (the same only when the call sees the whole batch).
    Returns:
      ``(loss float32 scalar, metrics)``. Summable over micro-batches like the loss: ``policy_loss``,
      ``kl_loss``, ``entropy_loss``. Means over this call's masked tokens: the policy's clip fractions and
      ratio stats, ``kl_k1`` and ``kl_k3`` (current vs ref), ``entropy``, and the mismatch-correction
      fractions; the entropy-control counts and fractions when it selects the tokens itself
      (``cov_selection`` None); ``batch_filter_skip`` (int32 0/1) when a threshold is set.

    Example: on policy (``rho = 1``) PPO's token loss is ``-A``; its token-mean is ``-(1 - 1 + 2) / 3``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import ObjectiveConfig, loss_normalizer, rl_objective
      >>> logp, adv, mask = jnp.full((2, 2), -1.0), jnp.array([[1.0, -1.0], [2.0, 0.0]]), jnp.array([[1, 1], [1, 0]])
      >>> normalizer = loss_normalizer("token-mean", mask)
      >>> round(float(rl_objective(ObjectiveConfig(), logp, logp, adv, mask, normalizer=normalizer)[0]), 4)
      -0.6667
    """
    if not isinstance(config, ObjectiveConfig):
        raise ValueError(f"config is a {type(config).__name__} but an ObjectiveConfig was expected")
    _validate.check_rank("logp", logp, 2)
    if config.bypass:
        _require("rollout_logp", rollout_logp, "ObjectiveConfig.bypass=True uses it as old_logp")
        anchor = rollout_logp
    else:
        _require("old_logp", old_logp, "ObjectiveConfig.bypass=False needs the learner's sampling-time logprobs")
        anchor = old_logp
    _validate.check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
                               rollout_logp=rollout_logp, ref_logp=ref_logp, entropy=entropy,
                               cov_selection=cov_selection)
    metrics: dict[str, Array] = {}
    if cov_selection is not None:
        if config.entropy_control == "none":
            raise ValueError("cov_selection was given but ObjectiveConfig.entropy_control='none' uses no "
                             "selection; set entropy_control to 'clip-cov' or 'kl-cov' or pass None")
        _validate.check_mask("cov_selection", cov_selection)
        # Padding rows may hold anything; only masked tokens are ever selected.
        cov_selection = cov_selection.astype(bool) & mask.astype(bool)
    elif config.entropy_control != "none":
        cov_selection, cov_metrics = entropy_control_selection(config, logp, advantages, mask, key=key)
        metrics.update(cov_metrics)
    mode = config.aggregation

    def aggregate(token_loss):
        return aggregation.aggregate_loss(token_loss, mask, mode, normalizer)

    pg_logp = logp
    if config.entropy_control == "clip-cov":
        pg_logp = jnp.where(cov_selection, jax.lax.stop_gradient(logp), logp)

    pg_loss, pg_metrics = policy.policy_token_loss(
        config.policy_loss, pg_logp, anchor, advantages, mask,
        eps_low=config.eps_low, eps_high=config.eps_high, dual_clip=config.dual_clip)
    metrics.update(pg_metrics)

    if config.mismatch_correction != "none" or config.batch_filter_threshold is not None:
        _require("rollout_logp", rollout_logp, "a mismatch correction or batch filter compares it with old_logp")
    if config.mismatch_correction != "none":
        weight, correction_metrics = _mismatch_weight(config, anchor, rollout_logp, mask, is_batch_mean)
        pg_loss = pg_loss * weight
        metrics.update(correction_metrics)

    if config.entropy_control == "kl-cov":
        pg_loss = pg_loss + entropy_lib.kl_cov_gap_penalty(logp, anchor, cov_selection, beta=config.kl_cov_beta)

    loss = aggregate(pg_loss)
    metrics["policy_loss"] = loss

    if ref_logp is not None:
        metrics["kl_k1"] = _masked_mean(kl_lib.kl_k1(logp, ref_logp), mask)
        metrics["kl_k3"] = _masked_mean(kl_lib.kl_k3(logp, ref_logp), mask)
    if config.kl_kind in kl_lib.AS_LOSS_KINDS:
        _require("ref_logp", ref_logp, f"ObjectiveConfig.kl_kind={config.kl_kind!r} regularises towards it")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the config already warned about k1-as-loss once
            if config.kl_off_policy_correction:
                kl_tokens, _ = kl_lib.kl_off_policy_token_loss(
                    config.kl_kind, logp, anchor, ref_logp, mask, policy_loss=config.policy_loss,
                    eps_low=config.eps_low, eps_high=config.eps_high, dual_clip=config.dual_clip,
                    clamp=config.kl_clamp)
            else:
                kl_tokens = kl_lib.kl_as_loss(config.kl_kind, logp, ref_logp, mask, clamp=config.kl_clamp)
        kl_loss = aggregate(kl_tokens)
        metrics["kl_loss"] = kl_loss
        loss = loss + config.kl_coef * kl_loss

    if config.entropy_coef > 0:
        _require("entropy", entropy, f"ObjectiveConfig.entropy_coef={config.entropy_coef} needs the token entropy")
        entropy_loss = aggregate(entropy_lib.entropy_bonus(entropy, mask, coef=config.entropy_coef))
        metrics["entropy_loss"] = entropy_loss
        loss = loss + entropy_loss
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy, mask)

    if config.batch_filter_threshold is not None:
        _, filter_metrics = mismatch.batch_filter(
            anchor, rollout_logp, mask, threshold=config.batch_filter_threshold, metric=config.batch_filter_metric)
        metrics.update(filter_metrics)
    return loss, metrics
