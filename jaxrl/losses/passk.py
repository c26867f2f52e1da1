"""Pass@k advantage estimators: GRPO pass@k (only a group's best response learns) and the
analytic advantages of Pass@k Training (docs/losses.md#grpo-passk, docs/losses.md#passk-training).
Groups, masks and layouts as in :mod:`jaxrl.losses.advantages`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses._groups import DEFAULT_STD_MIN, as_groups, check_std_args, clip_std, group_output, group_stats

Array = jax.Array


def grpo_passk_advantages(
    rewards: Array,
    *,
    group_size: int | None = None,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    mask: Array | None = None,
    std_min: float = DEFAULT_STD_MIN,
    std_max: float = float("inf"),
    ddof: int = 1,
    scale_by_std: bool = True,
) -> tuple[Array, dict[str, Array]]:
    """GRPO pass@k (max@G): only a group's best response gets an advantage,
    ``A_best = (r_(1) - r_(2)) / clip(std_g r, std_min, std_max)``, every other ``A_i = 0``
    (docs/losses.md#grpo-passk).

    ``r_(1) >= r_(2)`` are the group's largest and second-largest rewards
    (counted with multiplicity: a tie for the best gives every sample 0). This
    is verl ``compute_grpo_passk_outcome_advantage``, which cites arXiv
    2503.19595: the leave-one-out gradient of the group maximum (pass@k with
    k = G for binary rewards), where only the maximum's own term survives. verl
    divides by ``std + 1e-6`` (``torch.std``, i.e. ``ddof=1``); here the std is
    clipped as in :func:`grpo_advantages`. For the analytic pass@k advantages
    of arXiv 2508.10751 for any k, see :func:`passk_advantages`.

    Args:
      rewards, mask: as :func:`grpo_advantages`; the max, runner-up and std run
        over the samples with mask 1, the others get 0. A group with fewer
        than 2 valid samples gets 0 (verl raises).
      std_min, std_max, ddof: the std clip and estimator, as in GRPO.
      scale_by_std: False gives ``r_(1) - r_(2)`` unscaled (verl
        ``norm_adv_by_std_in_grpo=False``).
    Returns:
      advantages (float32, shape of ``rewards``), metrics
      ``{"zero_variance_groups": int32 scalar}``.

    Example: group ``[1, 0, 0]``, gap ``1 - 0``, sample std ``1 / sqrt(3)``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import grpo_passk_advantages
      >>> adv, _ = grpo_passk_advantages(jnp.array([[1.0, 0.0, 0.0]]))
      >>> [round(float(a), 4) for a in adv[0]]
      [1.7321, 0.0, 0.0]
    """
    check_std_args(std_min, std_max, ddof)
    groups = as_groups(rewards, group_size, group_ids, num_groups, mask)
    ids, n, live, r = groups.ids, groups.num_groups, groups.live, groups.rewards
    count, _, std, zero_variance = group_stats(groups, ddof)
    best = jax.ops.segment_max(jnp.where(live, r, -jnp.inf), ids, n)[ids]
    is_best = live & (r == best)
    num_best = jax.ops.segment_sum(is_best.astype(jnp.int32), ids, n)[ids]
    runner_up = jax.ops.segment_max(jnp.where(live & (r < best), r, -jnp.inf), ids, n)[ids]
    gap = jnp.where(is_best & (num_best == 1) & (count >= 2), best - runner_up, 0.0)
    if scale_by_std:
        gap = gap / clip_std(std, std_min, std_max)
    return group_output(groups, gap, zero_variance)


def _binomial_ratio(top: Array, bottom: Array, k: int) -> Array:
    """``C(top, k) / C(bottom, k)`` for ``bottom >= k``, as ``prod_{i<k} max(top - i, 0) / (bottom - i)``."""
    i = jnp.arange(k, dtype=jnp.float32)
    factors = jnp.maximum(top[..., None] - i, 0.0) / jnp.maximum(bottom[..., None] - i, 1.0)
    return jnp.prod(factors, axis=-1)


def passk_advantages(
    rewards: Array,
    *,
    k: int,
    group_size: int | None = None,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    mask: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Pass@k Training, analytic advantages (docs/losses.md#passk-training; arXiv 2508.10751).

    For a group of ``n`` binary-reward responses of which ``c`` are correct,
    the group reward of pass@k training (the max over a random ``k``-subset)
    has mean ``rho = 1 - C(n-c, k) / C(n, k)`` and std ``sigma = sqrt(rho (1 - rho))``;
    averaging the ``k``-subset advantages over the subsets that hold a response gives

        A_pos = (1 - rho) / sigma,
        A_neg = (1 - rho - C(n-c-1, k-1) / C(n-1, k-1)) / sigma.

    ``k = 1`` is GRPO with the population std and no clip. A group in which
    every ``k``-subset holds a correct response (``n - c < k``), or none does,
    has ``sigma = 0`` and gets 0 (the paper adds 1e-6 to ``sigma``, and the
    numerators are then 0 too).

    Args:
      rewards: as :func:`grpo_advantages`; binary 0/1 rewards, a sample counts
        as correct when ``r > 0.5`` (the authors' code tests ``r == 1``).
      k: the ``k`` of pass@k, a positive Python int; a group with fewer than
        ``k`` valid samples gets 0.
      mask: optional bool/0-1 of the shape of ``rewards``; ``n`` and ``c``
        count the samples with mask 1, the others get 0.
    Returns:
      advantages (float32, shape of ``rewards``), metrics
      ``{"zero_variance_groups": int32 scalar}``.

    Example: ``n = 4, c = 1, k = 2``: ``rho = 1 - 3/6 = 0.5 = sigma``, ``A_pos = 1``,
    ``A_neg = (0.5 - 2/3) / 0.5``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import passk_advantages
      >>> adv, _ = passk_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), k=2, group_size=4)
      >>> [round(float(a), 4) for a in adv]
      [1.0, -0.3333, -0.3333, -0.3333]
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be a positive Python int (the k of pass@k)")
    groups = as_groups(rewards, group_size, group_ids, num_groups, mask)
    ids, n_groups, live = groups.ids, groups.num_groups, groups.live
    correct = live & (groups.rewards > 0.5)
    n, _, _, zero_variance = group_stats(groups, ddof=0)
    c = jax.ops.segment_sum(correct.astype(jnp.float32), ids, n_groups)[ids]
    rho = 1.0 - _binomial_ratio(n - c, n, k)
    sigma = jnp.sqrt(jnp.maximum(rho * (1.0 - rho), 0.0))
    a_neg_hit = _binomial_ratio(n - c - 1.0, n - 1.0, k - 1)
    numerator = jnp.where(correct, 1.0 - rho, 1.0 - rho - a_neg_hit)
    adv = jnp.where((n >= k) & (sigma > 0), numerator / jnp.where(sigma > 0, sigma, 1.0), 0.0)
    return group_output(groups, adv, zero_variance)
