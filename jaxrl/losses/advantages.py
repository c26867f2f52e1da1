"""Advantage estimators (docs/losses.md#advantage-estimators).

Group estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline, OPO, GRPO pass@k, Pass@k Training) accept the
groups in one of three layouts, and return advantages in the layout they were given:

* ``rewards`` of shape ``[num_groups, G]``: one row per prompt;
* ``rewards`` of shape ``[B]`` with ``group_size=G``: contiguous groups (``B`` must be a multiple of ``G``);
* ``rewards`` of shape ``[B]`` with integer ``group_ids`` of shape ``[B]`` in ``[0, num_groups)`` and a static
  ``num_groups``: arbitrary order and group sizes (computed with segment sums, so it works under ``jit``).

The sequence-level estimators take an optional ``mask`` of the shape of ``rewards``: samples with mask 0 (e.g.
unparsable responses) enter no statistic, neither their group's baseline nor a batch mean or std, and get
advantage 0; every statistic below runs over the samples with mask 1.

Each returns ``(advantages, metrics)``; ``metrics["zero_variance_groups"]`` counts groups with at least one
(unmasked) sample whose rewards are all equal (they get zero advantage and waste rollout compute: Motif
"difficulty alignment"). Everything is computed in float32.

Two estimators need a second per-sample input of the shape of ``rewards``: OPO the response ``lengths``, ReMax
the ``baseline_rewards`` (the reward of a greedy response to each sample's prompt).

:data:`ADVANTAGE_ESTIMATORS` names the sequence-level estimators; :class:`AdvantageConfig` picks one and
:func:`sequence_advantages` applies it to a rollout batch of prompt groups.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses import _validate
from jaxrl.losses._groups import (DEFAULT_STD_MIN, Groups, as_groups, check_std_args, clip_std, group_output,
                                  group_stats, live_mask)
from jaxrl.losses.gae import gae_advantages
from jaxrl.losses.passk import grpo_passk_advantages, passk_advantages

Array = jax.Array


def grpo_advantages(
    rewards: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    mask: Array | None = None,
    std_min: float = DEFAULT_STD_MIN,
    std_max: float = float("inf"),
    ddof: int = 1,
) -> tuple[Array, dict[str, Array]]:
    """GRPO: ``A = (r - mean_g r) / clip(std_g r, std_min, std_max)``
    (docs/losses.md#grpo-and-the-std-clip, Rethinking-KL appendix J).

    Args:
      rewards: float ``[num_groups, G]``, or ``[B]`` with ``group_size`` or ``group_ids``/``num_groups``
        (see module docstring).
      mask: optional bool/0-1 of the shape of ``rewards``; the group statistics run over the samples with
        mask 1, the others get 0.
      std_min, std_max: the std clip; ``std_min > 0`` is required (appendix J: with r = [0.99999, 1.00001,
        0.99999, 1.00001] plain normalisation gives +-0.866, std_min = 0.1 keeps the advantages ~+-1e-4).
      ddof: 1 for the sample std (the appendix's figure), 0 for population std.
    Returns: advantages (float32, same shape as ``rewards``), metrics ``{"zero_variance_groups": int32 scalar}``.

    >>> [round(float(a), 4) for a in grpo_advantages(jnp.array([[1.0, 0.0], [1.0, 1.0]]))[0].ravel()]  # std sqrt(.5)
    [0.7071, -0.7071, 0.0, 0.0]
    """
    check_std_args(std_min, std_max, ddof)
    groups = as_groups(rewards, group_size, group_ids, num_groups, mask)
    _, mean, std, zero_variance = group_stats(groups, ddof)
    return group_output(groups, (groups.rewards - mean) / clip_std(std, std_min, std_max), zero_variance)


def dr_grpo_advantages(
    rewards: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    mask: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Dr.GRPO: ``A = r - mean_g r`` (docs/losses.md#dr-grpo), no std division.

    Shapes and ``mask`` as :func:`grpo_advantages`.

    >>> [round(float(a), 4) for a in dr_grpo_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), group_size=4)[0]]  # r - 1/4
    [0.75, -0.25, -0.25, -0.25]
    """
    groups = as_groups(rewards, group_size, group_ids, num_groups, mask)
    _, mean, _, zero_variance = group_stats(groups, ddof=0)
    return group_output(groups, groups.rewards - mean, zero_variance)


def rloo_advantages(
    rewards: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    mask: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j`` (docs/losses.md#rloo).

    Shapes and ``mask`` as :func:`grpo_advantages` (``j`` runs over the group's samples with mask 1). A group
    of one response has no leave-one-out baseline and gets advantage 0.

    >>> [round(float(a), 4) for a in rloo_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), group_size=4)[0]]  # 1-0, 0-1/3
    [1.0, -0.3333, -0.3333, -0.3333]
    """
    groups = as_groups(rewards, group_size, group_ids, num_groups, mask)
    count, mean, _, zero_variance = group_stats(groups, ddof=0)
    # r_i - (sum - r_i)/(G-1) = G/(G-1) * (r_i - mean)
    scale = jnp.where(count > 1, count / jnp.maximum(count - 1.0, 1.0), 0.0)
    return group_output(groups, scale * (groups.rewards - mean), zero_variance)


def reinforce_advantages(
    rewards: Array,
    *,
    mask: Array | None = None,
    std_min: float = 1e-6,
    std_max: float = float("inf"),
    ddof: int = 0,
) -> tuple[Array, dict[str, Array]]:
    """REINFORCE / REINFORCE++: batch normalisation ``A = (r - mean_B r) / clip(std_B r)``
    (docs/losses.md#batch-normalised-estimators).

    Args:
      rewards: float, any shape (every element is one sample of the batch); normalise over the full batch,
        not a micro-batch.
      mask: optional bool/0-1 of the shape of ``rewards``; ``mean_B`` and ``std_B`` run over the samples
        with mask 1, the others get 0.
      std_min, std_max, ddof: std clip and estimator, as in GRPO (the default floor is tiny: a batch std
        rarely collapses).
    Returns: advantages (float32, shape of ``rewards``), metrics
      ``{"zero_variance_groups": 1 if the whole batch is constant else 0}``.

    >>> [round(float(a), 4) for a in reinforce_advantages(jnp.array([3.0, 1.0, 100.0]), mask=jnp.array([1, 1, 0]))[0]]
    [1.0, -1.0, 0.0]
    """
    check_std_args(std_min, std_max, ddof)
    _validate.check_floating("rewards", rewards)
    flat = jnp.asarray(rewards, jnp.float32).reshape(-1)
    groups = Groups(flat, jnp.zeros(flat.shape, jnp.int32), live_mask(rewards, mask), 1, tuple(jnp.shape(rewards)))
    _, mean, std, zero_variance = group_stats(groups, ddof)
    return group_output(groups, (flat - mean) / clip_std(std, std_min, std_max), zero_variance)


def reinforce_pp_baseline_advantages(
    rewards: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    mask: Array | None = None,
    std_min: float = 1e-6,
    std_max: float = float("inf"),
    ddof: int = 0,
) -> tuple[Array, dict[str, Array]]:
    """REINFORCE++-baseline: ``A = batchnorm(r - mean_g r)`` (docs/losses.md#batch-normalised-estimators): group
    baseline, then batch normalisation.

    Shapes and ``mask`` as :func:`grpo_advantages`; the group means and the batch statistics run over every
    element given with mask 1, so pass the full batch. ``zero_variance_groups`` counts the groups, whose
    centred rewards are then all zero.

    >>> [round(float(a), 4) for a in reinforce_pp_baseline_advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), group_size=2)[0]]
    [1.4142, -1.4142, 0.0, 0.0]
    """
    check_std_args(std_min, std_max, ddof)
    groups = as_groups(rewards, group_size, group_ids, num_groups, mask)
    _, mean, _, zero_variance = group_stats(groups, ddof=0)
    centred = groups.rewards - mean
    batch = groups._replace(rewards=centred, ids=jnp.zeros_like(groups.ids), num_groups=1)
    _, batch_mean, batch_std, _ = group_stats(batch, ddof)
    return group_output(groups, (centred - batch_mean) / clip_std(batch_std, std_min, std_max), zero_variance)


def _check_lengths_or_baselines(name: str, x, rewards) -> None:
    """A per-sample numeric input (``lengths``, ``baseline_rewards``) shaped like ``rewards``."""
    dtype = jnp.result_type(x)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise ValueError(f"{name} has dtype {dtype} but a numeric (integer or floating) dtype was expected")
    _validate.check_same_shape(rewards=rewards, **{name: x})


def opo_advantages(
    rewards: Array,
    lengths: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    mask: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """OPO: ``A_i = r_i - b_g``, ``b_g = sum_j L_j r_j / sum_j L_j`` (docs/losses.md#opo).

    On-Policy RL with Optimal reward baseline (arXiv 2505.23585): the variance-minimising baseline
    ``E[|grad log pi|^2 r] / E[|grad log pi|^2]`` with the squared gradient norm taken proportional to the
    response length, i.e. the length-weighted mean reward of the prompt's group (verl
    ``compute_opo_outcome_advantage``). No std division.

    Args:
      rewards: float ``[num_groups, G]``, or ``[B]`` with ``group_size`` or ``group_ids``/``num_groups``
        (see module docstring).
      lengths: ``L_i`` >= 0, the number of generated tokens of each response, integer or float of the shape
        of ``rewards``.
      mask: optional bool/0-1 of the shape of ``rewards``; ``j`` runs over the group's samples with mask 1,
        the others get 0.
    Returns: advantages (float32, shape of ``rewards``), metrics ``{"zero_variance_groups": int32 scalar}``.

    A group whose valid lengths sum to 0 falls back to the plain mean. A group of one valid response gets
    advantage 0 (``b = r``); verl instead gives it the baseline 0, i.e. ``A = r``.

    >>> [round(float(a), 4) for a in opo_advantages(jnp.array([1.0, 0.0]), jnp.array([3, 1]), group_size=2)[0]]  # b=3/4
    [0.25, -0.75]
    """
    _check_lengths_or_baselines("lengths", lengths, rewards)
    groups = as_groups(rewards, group_size, group_ids, num_groups, mask)
    ids, n, live = groups.ids, groups.num_groups, groups.live
    weight = jnp.where(live, jnp.asarray(lengths, jnp.float32).reshape(-1), 0.0)
    total = jax.ops.segment_sum(weight, ids, n)
    weighted = jax.ops.segment_sum(jnp.where(live, weight * groups.rewards, 0.0), ids, n)
    _, mean, _, zero_variance = group_stats(groups, ddof=0)
    baseline = jnp.where(total[ids] > 0, weighted[ids] / jnp.maximum(total[ids], 1e-30), mean)
    return group_output(groups, groups.rewards - baseline, zero_variance)


def remax_advantages(
    rewards: Array,
    baseline_rewards: Array,
    *,
    mask: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """ReMax: ``A_i = r_i - r(x_i, y_greedy)`` (docs/losses.md#remax).

    ReMax (arXiv 2310.10505): REINFORCE whose baseline is the reward of the greedy (argmax-decoded) response
    to the same prompt; verl ``compute_remax_outcome_advantage`` (outcome reward: every token's return is
    ``r_i``). No group statistic, so it works with one sample per prompt.

    Args:
      rewards: float, any shape, one reward per sample.
      baseline_rewards: ``[...]`` of the shape of ``rewards``: for each sample, the reward of the greedy
        response to its prompt (repeat it over the prompt's samples).
      mask: optional bool/0-1 of the shape of ``rewards``; samples with mask 0 get 0.
    Returns: advantages (float32, shape of ``rewards``), metrics
      ``{"zero_variance_groups": 1 if the valid rewards of the whole batch are all equal else 0}``
      (as :func:`reinforce_advantages`: there are no groups here).

    >>> [round(float(a), 4) for a in remax_advantages(jnp.array([1.0, 0.0, 1.0]), jnp.array([1.0, 1.0, 0.0]))[0]]
    [0.0, -1.0, 1.0]
    """
    _validate.check_floating("rewards", rewards)
    _check_lengths_or_baselines("baseline_rewards", baseline_rewards, rewards)
    flat = jnp.asarray(rewards, jnp.float32).reshape(-1)
    groups = Groups(flat, jnp.zeros(flat.shape, jnp.int32), live_mask(rewards, mask), 1, tuple(jnp.shape(rewards)))
    _, _, _, zero_variance = group_stats(groups, ddof=0)
    return group_output(groups, flat - jnp.asarray(baseline_rewards, jnp.float32).reshape(-1), zero_variance)


def broadcast_to_tokens(sequence_values: Array, mask: Array) -> Array:
    """``A_{b,t} = A_b * mask_{b,t}``: sequence advantages to tokens (docs/losses.md#advantage-estimators).

    Args:
      sequence_values: float ``[B]``.
      mask: bool/0-1 ``[B, T]``.
    Returns: float32 ``[B, T]``, zero at masked positions.

    >>> broadcast_to_tokens(jnp.array([2.0, 0.5]), jnp.array([[1, 1, 0], [1, 0, 0]])).tolist()
    [[2.0, 2.0, 0.0], [0.5, 0.0, 0.0]]
    """
    _validate.check_floating("sequence_values", sequence_values)
    _validate.check_rank("sequence_values", sequence_values, 1)
    _validate.check_rank("mask", mask, 2)
    _validate.check_mask("mask", mask)
    if jnp.shape(mask)[0] != jnp.shape(sequence_values)[0]:
        raise ValueError(
            f"sequence_values has {jnp.shape(sequence_values)[0]} entries but mask has "
            f"{jnp.shape(mask)[0]} rows; expected one value per sequence"
        )
    return jnp.asarray(sequence_values, jnp.float32)[:, None] * jnp.asarray(mask, jnp.float32)


# Sequence-level estimator name -> estimator: the one declaration of ``AdvantageConfig.estimator``'s choices.
ADVANTAGE_ESTIMATORS = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce": reinforce_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "opo": opo_advantages,
    "remax": remax_advantages,
    "grpo_passk": grpo_passk_advantages,
    "passk": passk_advantages,
}
# Token-level estimator name -> estimator: these need a critic's values per token, so the trainer runs
# them itself (jaxrl.trainer.stages.advantage.critic), not through sequence_advantages.
TOKEN_ADVANTAGE_ESTIMATORS = {
    "gae": gae_advantages,
}
# Every choice of ``AdvantageConfig.estimator``: the sequence-level ones, then the token-level ones.
ESTIMATOR_CHOICES = (*ADVANTAGE_ESTIMATORS, *TOKEN_ADVANTAGE_ESTIMATORS)
# Estimators whose baseline is a statistic of the prompt's group of samples (they take group_size).
GROUPED_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "grpo_passk", "passk")
# Estimator -> {its keyword argument: the AdvantageConfig field that sets it}.
_CONFIG_OPTIONS = {
    "grpo": {"std_min": "std_min", "std_max": "std_max", "ddof": "ddof"},
    "grpo_passk": {"std_min": "std_min", "std_max": "std_max", "ddof": "ddof"},
    "passk": {"k": "passk_k"},
}


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """estimator: one of the loss library's advantage estimators (docs/losses.md#advantage-estimators):
    a sequence-level one (``ADVANTAGE_ESTIMATORS``) or "gae" (``TOKEN_ADVANTAGE_ESTIMATORS``: PPO with
    a critic, docs/losses.md#gae-with-a-critic); std clip for GRPO and GRPO pass@k; passk_k: the k of
    "passk" (Pass@k Training); gamma, lam: GAE's discount and lambda, in [0, 1].

    >>> AdvantageConfig(estimator="remax").needs_greedy_baseline, AdvantageConfig(estimator="gae").needs_critic
    (True, True)
    """

    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp_baseline", "opo", "remax",
                       "grpo_passk", "passk", "gae"] = "grpo"
    std_min: float = 0.1
    std_max: float = 1e6
    ddof: Literal[0, 1] = 1
    passk_k: int = 4
    gamma: float = 1.0
    lam: float = 0.95

    # Estimators whose baseline is a statistic of the prompt's group of samples.
    GROUPED = GROUPED_ESTIMATORS

    @property
    def needs_greedy_baseline(self) -> bool:
        """Whether the rollout must also decode one greedy response per prompt ("remax")."""
        return self.estimator == "remax"

    @property
    def needs_critic(self) -> bool:
        """Whether the estimator is token-level and needs a critic's values ("gae")."""
        return self.estimator in TOKEN_ADVANTAGE_ESTIMATORS

    def __post_init__(self):
        _validate.check_choice("advantage.estimator", self.estimator, ESTIMATOR_CHOICES)
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"advantage.{name}={value!r} must be a number in [0, 1] (GAE's "
                                 f"{'discount' if name == 'gamma' else 'lambda'})")
        if not 0.0 < self.std_min <= self.std_max:
            raise ValueError(
                f"advantage.std_min ({self.std_min}) must be > 0 and <= advantage.std_max ({self.std_max}); "
                f"a zero floor divides a zero-variance group by zero")
        if isinstance(self.passk_k, bool) or not isinstance(self.passk_k, int) or self.passk_k < 1:
            raise ValueError(f"advantage.passk_k={self.passk_k!r} must be a positive int (the k of pass@k)")


def _per_sample_input(name: str, values, n: int, valid: np.ndarray, why: str) -> np.ndarray:
    """``values`` as float32 ``[n]``, finite on the valid samples; raises naming ``name``."""
    values = np.asarray(values)
    if values.shape != (n,):
        raise ValueError(f"{name} has shape {values.shape} but {(n,)} was expected ({why})")
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise ValueError(f"{name} has dtype {values.dtype} but a numeric dtype was expected ({why})")
    values = values.astype(np.float32)
    if not np.isfinite(values[valid]).all():
        raise ValueError(f"{name} holds non-finite values on valid samples ({why})")
    return values


@functools.cache
def _jitted_estimator(name: str, options: tuple[str, ...]):
    """One compiled program per estimator and option values (the options are static), not a
    dispatch per array operation on every step."""
    return jax.jit(ADVANTAGE_ESTIMATORS[name], static_argnames=options)


def sequence_advantages(config: AdvantageConfig, scores: np.ndarray, valid: np.ndarray, group_size: int, *,
                        lengths: np.ndarray | None = None,
                        baselines: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """[N] float32 advantages for N = prompts * G samples in prompt-major order (docs/losses.md#advantage-estimators).

    Samples with ``valid == False`` (unparsable, masked) enter no statistic (their group's baseline, the batch
    mean and std of "reinforce" and "reinforce_pp_baseline") and get advantage 0. The metric
    ``advantage/zero_variance_group_fraction`` is the fraction of prompt groups whose valid samples all have
    the same score (for every estimator).

    Estimator inputs beyond the scores (ignored by the other estimators):
      lengths: ``[N]``, the number of generated tokens of each response; required by "opo".
      baselines: the reward of the greedy response to each prompt, ``[N]`` (one per sample) or ``[N // G]``
        (one per prompt, repeated over its group); required by "remax".

    >>> adv, m = sequence_advantages(AdvantageConfig(estimator="dr_grpo"), np.array([1.0, 0, 1, 1]), [True] * 4, 2)
    >>> adv.tolist(), m["advantage/zero_variance_group_fraction"]  # Dr.GRPO; the second group is constant
    ([0.5, -0.5, 0.0, 0.0], 0.5)
    """
    if config.needs_critic:
        raise ValueError(
            f"advantage.estimator={config.estimator!r} is token-level: it needs a critic's values per token and "
            f"is computed with gae_advantages (the trainer's critic does), not by sequence_advantages")
    n = len(scores)
    valid = np.asarray(valid, bool)
    num_prompts = n // group_size
    options = {arg: getattr(config, field) for arg, field in _CONFIG_OPTIONS.get(config.estimator, {}).items()}
    if config.estimator in GROUPED_ESTIMATORS:
        options["group_size"] = group_size
    if config.estimator == "passk" and config.passk_k > group_size:
        raise ValueError(
            f"advantage.passk_k={config.passk_k} exceeds the group size {group_size}: a pass@k estimate needs "
            f"k <= G samples per prompt, every group would get advantage 0; set advantage.passk_k <= "
            f"rollout.group_size")
    arrays = ()
    if config.estimator == "opo":
        if lengths is None:
            raise ValueError(
                "advantage.estimator='opo' weights the group baseline by response length: pass "
                "lengths=[N] (the number of generated tokens of each sample) to sequence_advantages")
        lengths = _per_sample_input("lengths", lengths, n, valid, "generated tokens per sample for 'opo'")
        if (lengths[valid] < 0).any():
            raise ValueError("lengths must be >= 0 (generated tokens per sample for 'opo')")
        arrays = (jnp.asarray(lengths),)
    elif config.estimator == "remax":
        if baselines is None:
            raise ValueError(
                "advantage.estimator='remax' subtracts the reward of a greedy response to each prompt: pass "
                "baselines=[N // group_size] (one per prompt) or [N] (one per sample) to sequence_advantages")
        baselines = np.asarray(baselines)
        if baselines.shape == (num_prompts,) and num_prompts * group_size == n:
            baselines = np.repeat(baselines, group_size)
        baselines = _per_sample_input("baselines", baselines, n, valid,
                                      f"the greedy reward of each prompt, [{num_prompts}] or [{n}], for 'remax'")
        arrays = (jnp.asarray(baselines),)
    adv, _ = _jitted_estimator(config.estimator, tuple(options))(
        jnp.asarray(scores, jnp.float32), *arrays, mask=jnp.asarray(valid, bool), **options)
    # The estimator's own zero-variance count is of the whole batch for "reinforce": the
    # fraction below counts prompt groups, valid samples only, whatever the estimator.
    valid_groups = [valid[i * group_size:(i + 1) * group_size] for i in range(num_prompts)]
    zero = sum(
        1 for i, v in enumerate(valid_groups)
        if v.any() and np.ptp(scores[i * group_size:(i + 1) * group_size][v]) == 0
    )
    return np.asarray(adv, np.float32), {"advantage/zero_variance_group_fraction": zero / max(num_prompts, 1)}
