"""Advantage estimators (docs/losses.md#advantage-estimators).

Group estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline) accept the groups
in one of three layouts, and return advantages in the layout they were given:

* ``rewards`` of shape ``[num_groups, G]``: one row per prompt;
* ``rewards`` of shape ``[B]`` with ``group_size=G``: contiguous groups
  (``B`` must be a multiple of ``G``);
* ``rewards`` of shape ``[B]`` with integer ``group_ids`` of shape ``[B]`` in
  ``[0, num_groups)`` and a static ``num_groups``: arbitrary order and group
  sizes (computed with segment sums, so it works under ``jit``).

The sequence-level estimators take an optional ``mask`` of the shape of
``rewards``: samples with mask 0 (e.g. unparsable responses) enter no
statistic, neither their group's baseline nor a batch mean or std, and get
advantage 0; every statistic below runs over the samples with mask 1.

Each returns ``(advantages, metrics)``; ``metrics["zero_variance_groups"]``
counts groups with at least one (unmasked) sample whose rewards are all equal
(they get zero advantage and waste rollout compute: Motif "difficulty
alignment").
Everything is computed in float32.

:data:`ADVANTAGE_ESTIMATORS` names the sequence-level estimators;
:class:`AdvantageConfig` picks one and :func:`sequence_advantages` applies it to
a rollout batch of prompt groups.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses import _validate

Array = jax.Array

# Appendix J recommends a floor that is small relative to the reward scale,
# e.g. 0.1 for rewards in [0, 1]; it leaves binary-reward groups untouched.
DEFAULT_STD_MIN = 0.1


class _Groups(NamedTuple):
    """Rewards as a flat ``[B]`` float32 vector with a group id per element."""

    rewards: Array  # [B] float32
    ids: Array  # [B] int32
    live: Array  # [B] bool, the samples that enter the statistics
    num_groups: int
    shape: tuple[int, ...]  # the caller's layout, restored on output


def _live(rewards, mask) -> Array:
    """The mask flattened to ``[B]`` bool (all True when None), checked against ``rewards``."""
    if mask is None:
        return jnp.ones(jnp.size(rewards), bool)
    _validate.check_mask("mask", mask)
    _validate.check_same_shape(rewards=rewards, mask=mask)
    return jnp.asarray(mask).astype(bool).reshape(-1)


def _as_groups(rewards, group_size, group_ids, num_groups, mask) -> _Groups:
    _validate.check_floating("rewards", rewards)
    _validate.check_rank("rewards", rewards, (1, 2))
    rewards = jnp.asarray(rewards)
    shape = tuple(rewards.shape)
    live = _live(rewards, mask)
    if rewards.ndim == 2:
        if group_size is not None or group_ids is not None:
            raise ValueError(
                f"rewards has shape {shape} ([num_groups, G] layout) so group_size and "
                f"group_ids must be None; got group_size={group_size!r}, "
                f"group_ids of shape {None if group_ids is None else jnp.shape(group_ids)}"
            )
        n, g = shape
        ids = jnp.repeat(jnp.arange(n, dtype=jnp.int32), g)
        return _Groups(rewards.reshape(-1).astype(jnp.float32), ids, live, n, shape)
    if (group_size is None) == (group_ids is None):
        raise ValueError(
            f"rewards has shape {shape} (flat layout): pass exactly one of group_size "
            f"(contiguous groups) or group_ids (with num_groups); got "
            f"group_size={group_size!r}, group_ids={'None' if group_ids is None else 'given'}"
        )
    if group_size is not None:
        _validate.check_divides("group_size", group_size, shape[0], "number of rewards")
        n = shape[0] // group_size
        ids = jnp.repeat(jnp.arange(n, dtype=jnp.int32), group_size)
        return _Groups(rewards.astype(jnp.float32), ids, live, n, shape)
    _validate.check_integer("group_ids", group_ids)
    _validate.check_same_shape(rewards=rewards, group_ids=group_ids)
    if not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(
            f"num_groups={num_groups!r}: with group_ids pass the number of groups as a "
            f"positive Python int (a static size, needed under jit)"
        )
    return _Groups(rewards.astype(jnp.float32), jnp.asarray(group_ids, jnp.int32), live, num_groups, shape)


def _group_stats(groups: _Groups, ddof: int):
    """Per-element group count, mean and std over the live samples, and the zero-variance group count."""
    ids, n, live = groups.ids, groups.num_groups, groups.live
    r = groups.rewards
    count = jax.ops.segment_sum(live.astype(jnp.float32), ids, n)
    mean = jax.ops.segment_sum(jnp.where(live, r, 0.0), ids, n) / jnp.maximum(count, 1.0)
    centred = r - mean[ids]
    sq = jax.ops.segment_sum(jnp.where(live, centred**2, 0.0), ids, n)
    # A group of size <= ddof has no std estimate: call it 0 (then std_min applies).
    var = jnp.where(count > ddof, sq / jnp.maximum(count - ddof, 1.0), 0.0)
    std = jnp.sqrt(var)
    spread = (jax.ops.segment_max(jnp.where(live, r, -jnp.inf), ids, n)
              - jax.ops.segment_min(jnp.where(live, r, jnp.inf), ids, n))
    zero_variance = jnp.sum((count > 0) & (spread == 0)).astype(jnp.int32)
    return count[ids], mean[ids], std[ids], zero_variance


def _output(groups: _Groups, adv: Array, zero_variance: Array) -> tuple[Array, dict[str, Array]]:
    """Advantages in the caller's layout, 0 where masked, and the metrics."""
    adv = jnp.where(groups.live, adv, 0.0)
    return adv.reshape(groups.shape), {"zero_variance_groups": zero_variance}


def _clip_std(std: Array, std_min: float, std_max: float) -> Array:
    return jnp.clip(std, std_min, std_max)


def _check_std_args(std_min, std_max, ddof):
    _validate.check_positive("std_min", std_min)
    _validate.check_ordered("std_min", std_min, "std_max", std_max)
    _validate.check_choice("ddof", ddof, (0, 1))


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
      rewards: float ``[num_groups, G]``, or ``[B]`` with ``group_size`` or
        ``group_ids``/``num_groups`` (see module docstring).
      mask: optional bool/0-1 of the shape of ``rewards``; the group statistics
        run over the samples with mask 1, the others get 0.
      std_min, std_max: the std clip; ``std_min > 0`` is required (appendix J:
        with r = [0.99999, 1.00001, 0.99999, 1.00001] plain normalisation gives
        +-0.866, std_min = 0.1 keeps the advantages ~+-1e-4).
      ddof: 1 for the sample std (the appendix's figure), 0 for population std.
    Returns:
      advantages (float32, same shape as ``rewards``), metrics
      ``{"zero_variance_groups": int32 scalar}``.
    """
    _check_std_args(std_min, std_max, ddof)
    groups = _as_groups(rewards, group_size, group_ids, num_groups, mask)
    _, mean, std, zero_variance = _group_stats(groups, ddof)
    return _output(groups, (groups.rewards - mean) / _clip_std(std, std_min, std_max), zero_variance)


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
    """
    groups = _as_groups(rewards, group_size, group_ids, num_groups, mask)
    _, mean, _, zero_variance = _group_stats(groups, ddof=0)
    return _output(groups, groups.rewards - mean, zero_variance)


def rloo_advantages(
    rewards: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    mask: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j`` (docs/losses.md#rloo).

    Shapes and ``mask`` as :func:`grpo_advantages` (``j`` runs over the group's
    samples with mask 1). A group of one response has no leave-one-out
    baseline and gets advantage 0.
    """
    groups = _as_groups(rewards, group_size, group_ids, num_groups, mask)
    count, mean, _, zero_variance = _group_stats(groups, ddof=0)
    # r_i - (sum - r_i)/(G-1) = G/(G-1) * (r_i - mean)
    scale = jnp.where(count > 1, count / jnp.maximum(count - 1.0, 1.0), 0.0)
    return _output(groups, scale * (groups.rewards - mean), zero_variance)


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
      rewards: float, any shape (every element is one sample of the batch);
        normalise over the full batch, not a micro-batch.
      mask: optional bool/0-1 of the shape of ``rewards``; ``mean_B`` and
        ``std_B`` run over the samples with mask 1, the others get 0.
      std_min, std_max, ddof: std clip and estimator, as in GRPO (the default
        floor is tiny: a batch std rarely collapses).
    Returns:
      advantages (float32, shape of ``rewards``), metrics
      ``{"zero_variance_groups": 1 if the whole batch is constant else 0}``.
    """
    _check_std_args(std_min, std_max, ddof)
    _validate.check_floating("rewards", rewards)
    flat = jnp.asarray(rewards, jnp.float32).reshape(-1)
    groups = _Groups(flat, jnp.zeros(flat.shape, jnp.int32), _live(rewards, mask), 1, tuple(jnp.shape(rewards)))
    _, mean, std, zero_variance = _group_stats(groups, ddof)
    return _output(groups, (flat - mean) / _clip_std(std, std_min, std_max), zero_variance)


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

    Shapes and ``mask`` as :func:`grpo_advantages`; the group means and the
    batch statistics run over every element given with mask 1, so pass the
    full batch. ``zero_variance_groups`` counts the groups, whose centred
    rewards are then all zero.
    """
    _check_std_args(std_min, std_max, ddof)
    groups = _as_groups(rewards, group_size, group_ids, num_groups, mask)
    _, mean, _, zero_variance = _group_stats(groups, ddof=0)
    centred = groups.rewards - mean
    batch = groups._replace(rewards=centred, ids=jnp.zeros_like(groups.ids), num_groups=1)
    _, batch_mean, batch_std, _ = _group_stats(batch, ddof)
    return _output(groups, (centred - batch_mean) / _clip_std(batch_std, std_min, std_max), zero_variance)


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


def broadcast_to_tokens(sequence_values: Array, mask: Array) -> Array:
    """``A_{b,t} = A_b * mask_{b,t}``: sequence advantages to tokens (docs/losses.md#advantage-estimators).

    Args:
      sequence_values: float ``[B]``.
      mask: bool/0-1 ``[B, T]``.
    Returns:
      float32 ``[B, T]``, zero at masked positions.
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
}
# Estimators whose baseline is a statistic of the prompt's group of samples (they take group_size).
GROUPED_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
# Estimators that normalise by a group std take the config's std clip options.
_STD_OPTIONS = {"grpo": ("std_min", "std_max", "ddof")}


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """estimator: one of the loss library's advantage estimators (docs/losses.md#advantage-estimators);
    std clip for GRPO."""

    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp_baseline"] = "grpo"
    std_min: float = 0.1
    std_max: float = 1e6
    ddof: Literal[0, 1] = 1

    # Estimators whose baseline is a statistic of the prompt's group of samples.
    GROUPED = GROUPED_ESTIMATORS

    def __post_init__(self):
        _validate.check_choice("advantage.estimator", self.estimator, ADVANTAGE_ESTIMATORS)
        if not 0.0 < self.std_min <= self.std_max:
            raise ValueError(
                f"advantage.std_min ({self.std_min}) must be > 0 and <= advantage.std_max ({self.std_max}); "
                f"a zero floor divides a zero-variance group by zero")


def sequence_advantages(config: AdvantageConfig, scores: np.ndarray, valid: np.ndarray,
                        group_size: int) -> tuple[np.ndarray, dict]:
    """[N] float32 advantages for N = prompts * G samples in prompt-major order (docs/losses.md#advantage-estimators).

    Samples with ``valid == False`` (unparsable, masked) enter no statistic (their
    group's baseline, the batch mean and std of "reinforce" and
    "reinforce_pp_baseline") and get advantage 0. The metric
    ``advantage/zero_variance_group_fraction`` is the fraction of prompt groups whose
    valid samples all have the same score (for every estimator).
    """
    n = len(scores)
    num_prompts = n // group_size
    options = {k: getattr(config, k) for k in _STD_OPTIONS.get(config.estimator, ())}
    if config.estimator in GROUPED_ESTIMATORS:
        options["group_size"] = group_size
    adv, _ = ADVANTAGE_ESTIMATORS[config.estimator](
        jnp.asarray(scores, jnp.float32), mask=jnp.asarray(valid, bool), **options)
    # The estimator's own zero-variance count is of the whole batch for "reinforce": the
    # fraction below counts prompt groups, valid samples only, whatever the estimator.
    valid_groups = [valid[i * group_size:(i + 1) * group_size] for i in range(num_prompts)]
    zero = sum(
        1 for i, v in enumerate(valid_groups)
        if v.any() and np.ptp(scores[i * group_size:(i + 1) * group_size][v]) == 0
    )
    return np.asarray(adv, np.float32), {"advantage/zero_variance_group_fraction": zero / max(num_prompts, 1)}
