"""Prompt groups for the group advantage estimators: the three input layouts, per-group
statistics over the valid samples, and the output in the caller's layout
(docs/losses.md#advantage-estimators)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate

Array = jax.Array

# Appendix J recommends a floor that is small relative to the reward scale,
# e.g. 0.1 for rewards in [0, 1]; it leaves binary-reward groups untouched.
DEFAULT_STD_MIN = 0.1


class Groups(NamedTuple):
    """Rewards as a flat ``[B]`` float32 vector with a group id per element."""

    rewards: Array  # [B] float32
    ids: Array  # [B] int32
    live: Array  # [B] bool, the samples that enter the statistics
    num_groups: int
    shape: tuple[int, ...]  # the caller's layout, restored on output


def live_mask(rewards, mask) -> Array:
    """The mask flattened to ``[B]`` bool (all True when None), checked against ``rewards``."""
    if mask is None:
        return jnp.ones(jnp.size(rewards), bool)
    _validate.check_mask("mask", mask)
    _validate.check_same_shape(rewards=rewards, mask=mask)
    return jnp.asarray(mask).astype(bool).reshape(-1)


def as_groups(rewards, group_size, group_ids, num_groups, mask) -> Groups:
    _validate.check_floating("rewards", rewards)
    _validate.check_rank("rewards", rewards, (1, 2))
    rewards = jnp.asarray(rewards)
    shape = tuple(rewards.shape)
    live = live_mask(rewards, mask)
    if rewards.ndim == 2:
        if group_size is not None or group_ids is not None:
            raise ValueError(
                f"rewards has shape {shape} ([num_groups, G] layout) so group_size and "
                f"group_ids must be None; got group_size={group_size!r}, "
                f"group_ids of shape {None if group_ids is None else jnp.shape(group_ids)}"
            )
        n, g = shape
        ids = jnp.repeat(jnp.arange(n, dtype=jnp.int32), g)
        return Groups(rewards.reshape(-1).astype(jnp.float32), ids, live, n, shape)
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
        return Groups(rewards.astype(jnp.float32), ids, live, n, shape)
    _validate.check_integer("group_ids", group_ids)
    _validate.check_same_shape(rewards=rewards, group_ids=group_ids)
    if not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(
            f"num_groups={num_groups!r}: with group_ids pass the number of groups as a "
            f"positive Python int (a static size, needed under jit)"
        )
    return Groups(rewards.astype(jnp.float32), jnp.asarray(group_ids, jnp.int32), live, num_groups, shape)


def group_stats(groups: Groups, ddof: int):
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


def group_output(groups: Groups, adv: Array, zero_variance: Array) -> tuple[Array, dict[str, Array]]:
    """Advantages in the caller's layout, 0 where masked, and the metrics."""
    adv = jnp.where(groups.live, adv, 0.0)
    return adv.reshape(groups.shape), {"zero_variance_groups": zero_variance}


def clip_std(std: Array, std_min: float, std_max: float) -> Array:
    return jnp.clip(std, std_min, std_max)


def check_std_args(std_min, std_max, ddof):
    _validate.check_positive("std_min", std_min)
    _validate.check_ordered("std_min", std_min, "std_max", std_max)
    _validate.check_choice("ddof", ddof, (0, 1))
