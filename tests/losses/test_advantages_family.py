"""OPO, ReMax, GRPO pass@k and Pass@k Training advantages against closed forms written here in numpy.

Every expected number comes from the estimator's definition (hand-made groups, numpy loops, brute force
over k-subsets), never from the code under test.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import losses
from jaxrl.losses import advantages as adv_lib


# --------------------------------------------------------------------------- #
# Reference implementations (one group at a time, plain numpy)
# --------------------------------------------------------------------------- #
def _np_opo(r, lengths):
    return r - np.sum(lengths * r) / np.sum(lengths)


def _np_grpo_passk(r, std_min=0.1, ddof=1):
    adv = np.zeros_like(r)
    if len(r) < 2:
        return adv
    order = np.argsort(-r, kind="stable")
    best, second = r[order[0]], r[order[1]]
    adv[order[0]] = (best - second) / max(np.std(r, ddof=ddof), std_min)
    return adv


def _np_passk(r, k):
    """The paper's closed form with math.comb."""
    n, c = len(r), int(np.sum(r == 1))
    if n < k:
        return np.zeros_like(r)
    rho = 1 - math.comb(n - c, k) / math.comb(n, k)
    sigma = math.sqrt(rho * (1 - rho))
    if sigma == 0:
        return np.zeros_like(r)
    pos = (1 - rho) / sigma
    neg = (1 - rho - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)) / sigma
    return np.where(r == 1, pos, neg)


def _brute_force_passk(r, k):
    """Each sample's advantage as the mean, over the k-subsets holding it, of (max(subset) - rho) / sigma."""
    subsets = list(itertools.combinations(range(len(r)), k))
    group_rewards = np.array([max(r[list(s)]) for s in subsets])
    rho, sigma = group_rewards.mean(), group_rewards.std()
    return np.array([np.mean([(max(r[list(s)]) - rho) / sigma for s in subsets if i in s]) for i in range(len(r))])


# --------------------------------------------------------------------------- #
# OPO
# --------------------------------------------------------------------------- #
def test_opo_hand_group():
    # b = (1*10 + 0*30 + 1*20 + 0*40) / 100 = 0.3.
    adv, metrics = adv_lib.opo_advantages(jnp.array([[1.0, 0.0, 1.0, 0.0]]), jnp.array([[10, 30, 20, 40]]))
    np.testing.assert_allclose(adv, [[0.7, -0.3, 0.7, -0.3]], rtol=1e-6)
    assert adv.dtype == jnp.float32 and int(metrics["zero_variance_groups"]) == 0
    # Equal lengths: the plain group mean (Dr.GRPO's baseline).
    adv, _ = adv_lib.opo_advantages(jnp.array([[1.0, 0.0, 0.0, 0.0]]), jnp.full((1, 4), 7.0))
    np.testing.assert_allclose(adv, [[0.75, -0.25, -0.25, -0.25]], rtol=1e-6)


def test_opo_several_prompts_in_every_layout():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(3, 5)).astype(np.float32)
    lengths = rng.integers(1, 50, size=(3, 5)).astype(np.int32)
    expected = np.stack([_np_opo(r[g], lengths[g]) for g in range(3)])
    grid, _ = adv_lib.opo_advantages(jnp.asarray(r), jnp.asarray(lengths))
    np.testing.assert_allclose(grid, expected, rtol=1e-5, atol=1e-6)
    flat, _ = adv_lib.opo_advantages(jnp.asarray(r.reshape(-1)), jnp.asarray(lengths.reshape(-1)), group_size=5)
    np.testing.assert_allclose(flat, expected.reshape(-1), rtol=1e-5, atol=1e-6)
    perm = rng.permutation(15)
    ids = np.repeat(np.arange(3), 5)[perm]
    shuffled, _ = adv_lib.opo_advantages(jnp.asarray(r.reshape(-1)[perm]), jnp.asarray(lengths.reshape(-1)[perm]),
                                         group_ids=jnp.asarray(ids), num_groups=3)
    np.testing.assert_allclose(shuffled, expected.reshape(-1)[perm], rtol=1e-5, atol=1e-6)


def test_opo_invalid_samples_leave_the_baseline_and_get_zero():
    # Group 0 valid: r [1, 0, 1] with L [2, 6, 2] -> b = 4/10; group 1: one valid sample -> b = r, A = 0.
    r = jnp.array([1.0, 0.0, 9.0, 1.0, 0.0, 1.0, 0.0, 5.0])
    lengths = jnp.array([2.0, 6.0, 1e6, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = jnp.array([1, 1, 0, 1, 0, 0, 1, 0], bool)
    adv, metrics = adv_lib.opo_advantages(r, lengths, group_size=4, mask=mask)
    np.testing.assert_allclose(adv, [0.6, -0.4, 0.0, 0.6, 0.0, 0.0, 0.0, 0.0], rtol=1e-6, atol=1e-7)
    assert int(metrics["zero_variance_groups"]) == 1  # the singleton
    poked, _ = adv_lib.opo_advantages(jnp.where(mask, r, jnp.nan), jnp.where(mask, lengths, jnp.nan), group_size=4,
                                      mask=mask)
    np.testing.assert_array_equal(poked, adv)


def test_opo_zero_total_length_falls_back_to_the_mean():
    adv, _ = adv_lib.opo_advantages(jnp.array([[1.0, 0.0]]), jnp.array([[0, 0]]))
    np.testing.assert_allclose(adv, [[0.5, -0.5]])


# --------------------------------------------------------------------------- #
# ReMax
# --------------------------------------------------------------------------- #
def test_remax_subtracts_the_greedy_reward_and_masks():
    r = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]], np.float32)
    greedy = np.array([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]], np.float32)
    adv, metrics = adv_lib.remax_advantages(jnp.asarray(r), jnp.asarray(greedy))
    np.testing.assert_allclose(adv, [[0.5, -0.5, 0.0], [-1.0, -1.0, 0.0]])
    assert int(metrics["zero_variance_groups"]) == 0
    mask = np.array([[1, 0, 1], [1, 1, 0]], bool)
    adv, _ = adv_lib.remax_advantages(jnp.where(mask, r, jnp.inf), jnp.asarray(greedy), mask=jnp.asarray(mask))
    np.testing.assert_allclose(adv, [[0.5, 0.0, 0.0], [-1.0, -1.0, 0.0]])
    # One sample per prompt (ReMax's own setting) is fine: there is no group statistic.
    adv, _ = adv_lib.remax_advantages(jnp.array([0.25]), jnp.array([1]))
    np.testing.assert_allclose(adv, [-0.75])


# --------------------------------------------------------------------------- #
# GRPO pass@k (verl compute_grpo_passk_outcome_advantage)
# --------------------------------------------------------------------------- #
def test_grpo_passk_hand_groups():
    # Best 0.9, runner-up 0.5; sample std of [0.2, 0.9, 0.5, 0.1]: mean 0.425,
    # squares 0.050625 + 0.225625 + 0.005625 + 0.105625 = 0.3875, / 3.
    std = math.sqrt(0.3875 / 3)
    r = jnp.array([[0.2, 0.9, 0.5, 0.1], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    adv, metrics = losses.grpo_passk_advantages(r, std_min=0.1)
    # One success in 4: sample variance 3/16 * 4/3 = 1/4, std 1/2, A = 2. A tie for the best gives 0.
    expected = [[0, 0.4 / std, 0, 0], [0, 2.0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-7)
    assert int(metrics["zero_variance_groups"]) == 1
    raw, _ = losses.grpo_passk_advantages(r, scale_by_std=False)
    np.testing.assert_allclose(raw, [[0, 0.4, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], atol=1e-6)
    # The std clip: a group of near-equal rewards is not blown up.
    tiny, _ = losses.grpo_passk_advantages(jnp.array([[1.0, 1.001, 1.0]]), std_min=0.1)
    np.testing.assert_allclose(tiny, [[0, 0.001 / 0.1, 0]], rtol=1e-3)


def test_grpo_passk_several_prompts_against_numpy():
    rng = np.random.default_rng(1)
    r = rng.normal(size=(4, 6)).astype(np.float32)
    expected = np.stack([_np_grpo_passk(row, std_min=0.1, ddof=1) for row in r])
    adv, _ = losses.grpo_passk_advantages(jnp.asarray(r.reshape(-1)), group_size=6)
    np.testing.assert_allclose(adv, expected.reshape(-1), rtol=1e-5, atol=1e-6)
    expected0 = np.stack([_np_grpo_passk(row, std_min=0.01, ddof=0) for row in r])
    adv0, _ = losses.grpo_passk_advantages(jnp.asarray(r), std_min=0.01, ddof=0)
    np.testing.assert_allclose(adv0, expected0, rtol=1e-5, atol=1e-6)


def test_grpo_passk_invalid_samples_are_never_the_best():
    # Group 0: the invalid 5.0 would be the best; over the valid [0.0, 1.0, 0.5] the best is 1.0.
    # Group 1: one valid sample, no runner-up -> 0.
    r = np.array([0.0, 1.0, 5.0, 0.5, 2.0, 0.0, 0.0, 0.0], np.float32)
    mask = np.array([1, 1, 0, 1, 1, 0, 0, 0], bool)
    adv, _ = losses.grpo_passk_advantages(jnp.asarray(r), group_size=4, mask=jnp.asarray(mask))
    want = np.zeros(8)
    want[1] = 0.5 / max(np.std([0.0, 1.0, 0.5], ddof=1), 0.1)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- #
# Pass@k Training (arXiv 2508.10751), analytic advantages
# --------------------------------------------------------------------------- #
def test_passk_hand_group():
    # n = 6, c = 2, k = 2: rho = 1 - C(4,2)/C(6,2) = 0.6, sigma = sqrt(0.24);
    # A_pos = 0.4 / sigma, A_neg = (0.4 - C(3,1)/C(5,1)) / sigma = -0.2 / sigma.
    adv, metrics = losses.passk_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0, 0.0, 0.0]]), k=2)
    s = math.sqrt(0.24)
    np.testing.assert_allclose(adv, [[0.4 / s, -0.2 / s, -0.2 / s, 0.4 / s, -0.2 / s, -0.2 / s]], rtol=1e-5)
    assert int(metrics["zero_variance_groups"]) == 0


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_passk_matches_closed_form_and_brute_force_over_subsets(k):
    groups = np.array([[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 1, 0], [0, 1, 0, 0, 0, 0, 1],
                       [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]], np.float32)
    adv, _ = losses.passk_advantages(jnp.asarray(groups.reshape(-1)), k=k, group_size=7)
    expected = np.stack([_np_passk(row, k) for row in groups])
    np.testing.assert_allclose(np.asarray(adv).reshape(groups.shape), expected, rtol=1e-5, atol=1e-6)
    for row, got in zip(groups, np.asarray(adv).reshape(groups.shape), strict=True):
        if 0 < row.sum() and len(row) - row.sum() >= k:  # sigma > 0
            np.testing.assert_allclose(got, _brute_force_passk(row, k), rtol=1e-5, atol=1e-6)


def test_passk_k1_is_grpo_with_population_std():
    row = np.array([1, 0, 0, 1, 1], np.float32)
    adv, _ = losses.passk_advantages(jnp.asarray(row)[None], k=1)
    np.testing.assert_allclose(adv[0], (row - row.mean()) / row.std(), rtol=1e-5)


def test_passk_saturated_groups_and_masks():
    # n - c < k: every 3-subset of [1, 1, 0, 0] holds a success, so nothing to learn.
    adv, _ = losses.passk_advantages(jnp.array([[1.0, 1.0, 0.0, 0.0]]), k=3)
    np.testing.assert_array_equal(adv, 0.0)
    # Masked: group 0 counts n = 4 valid, c = 1 (the masked 1 is not a success); group 1 has 2 < k valid.
    r = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0], np.float32)
    mask = np.array([1, 1, 0, 1, 1, 1, 1, 0, 0, 0], bool)
    adv, _ = losses.passk_advantages(jnp.asarray(r), k=3, group_size=5, mask=jnp.asarray(mask))
    want = np.zeros(10)
    want[[0, 1, 3, 4]] = _np_passk(np.array([1.0, 0.0, 0.0, 0.0]), 3)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- #
# Under jit, bad input, the config
# --------------------------------------------------------------------------- #
def test_new_estimators_jit():
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    lengths = jnp.array([1, 2, 3, 4, 5, 6])
    np.testing.assert_allclose(jax.jit(lambda x, n: adv_lib.opo_advantages(x, n, group_size=3)[0])(r, lengths),
                               np.concatenate([_np_opo(np.asarray(r[:3]), np.arange(1, 4)),
                                               _np_opo(np.asarray(r[3:]), np.arange(4, 7))]), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda x, b: adv_lib.remax_advantages(x, b)[0])(r, r), 0.0)
    np.testing.assert_allclose(jax.jit(lambda x: losses.grpo_passk_advantages(x, group_size=3)[0])(r),
                               np.concatenate([_np_grpo_passk(np.asarray(r[:3])), _np_grpo_passk(np.asarray(r[3:]))]),
                               rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda x: losses.passk_advantages(x, k=2, group_size=6)[0])(r),
                               _np_passk(np.asarray(r), 2), rtol=1e-5)


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda: adv_lib.opo_advantages(jnp.ones(4), jnp.ones(3), group_size=2), ["lengths", "(3,)", "(4,)"]),
        (lambda: adv_lib.opo_advantages(jnp.ones(4), jnp.ones(4, bool), group_size=2), ["lengths", "bool"]),
        (lambda: adv_lib.remax_advantages(jnp.ones(4), jnp.ones((2, 2))), ["baseline_rewards", "(2, 2)"]),
        (lambda: adv_lib.remax_advantages(jnp.ones(4, jnp.int32), jnp.ones(4)), ["rewards", "int32"]),
        (lambda: losses.grpo_passk_advantages(jnp.ones((2, 3)), std_min=0.0), ["std_min"]),
        (lambda: losses.passk_advantages(jnp.ones((2, 3)), k=0), ["k=0"]),
        (lambda: losses.passk_advantages(jnp.ones(6), k=2), ["group_size", "group_ids"]),
    ],
)
def test_bad_input_names_the_argument(call, names):
    with pytest.raises(ValueError) as err:
        call()
    for name in names:
        assert name in str(err.value)


def test_config_registers_the_new_estimators():
    for name in ("opo", "remax", "grpo_passk", "passk"):
        assert name in adv_lib.ADVANTAGE_ESTIMATORS
        adv_lib.AdvantageConfig(estimator=name)
    assert {"opo", "grpo_passk", "passk"} <= set(adv_lib.GROUPED_ESTIMATORS)
    assert "remax" not in adv_lib.GROUPED_ESTIMATORS
    assert losses.opo_advantages is adv_lib.opo_advantages and losses.passk_advantages is losses.passk_advantages
    assert losses.remax_advantages is adv_lib.remax_advantages
    assert losses.grpo_passk_advantages is losses.grpo_passk_advantages
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="advantage.passk_k"):
            adv_lib.AdvantageConfig(estimator="passk", passk_k=bad)


# --------------------------------------------------------------------------- #
# sequence_advantages with the new inputs
# --------------------------------------------------------------------------- #
SCORES = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], np.float32)
VALID = np.array([True, True, False, True, True, True])


def test_sequence_advantages_opo_uses_lengths_of_valid_samples():
    lengths = np.array([10, 30, 999, 5, 10, 5])
    config = adv_lib.AdvantageConfig(estimator="opo")
    adv, metrics = adv_lib.sequence_advantages(config, SCORES, VALID, 3, lengths=lengths)
    # Group 0 valid r [1, 0], L [10, 30] -> b = 1/4; group 1 r [0, 0, 1], L [5, 10, 5] -> b = 1/4.
    np.testing.assert_allclose(adv, [0.75, -0.25, 0.0, -0.25, -0.25, 0.75], rtol=1e-6)
    assert adv.dtype == np.float32 and metrics == {"advantage/zero_variance_group_fraction": 0.0}
    with pytest.raises(ValueError, match=r"advantage.estimator='opo'.*lengths"):
        adv_lib.sequence_advantages(config, SCORES, VALID, 3)
    with pytest.raises(ValueError, match=r"lengths has shape \(5,\)"):
        adv_lib.sequence_advantages(config, SCORES, VALID, 3, lengths=lengths[:5])
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        adv_lib.sequence_advantages(config, SCORES, VALID, 3, lengths=-lengths)


def test_sequence_advantages_remax_takes_per_prompt_or_per_sample_baselines():
    config = adv_lib.AdvantageConfig(estimator="remax")
    want = [0.5, -0.5, 0.0, -1.0, -1.0, 0.0]
    per_prompt, _ = adv_lib.sequence_advantages(config, SCORES, VALID, 3, baselines=np.array([0.5, 1.0]))
    np.testing.assert_allclose(per_prompt, want)
    per_sample, _ = adv_lib.sequence_advantages(config, SCORES, VALID, 3,
                                                baselines=np.array([0.5, 0.5, 0.5, 1.0, 1.0, 1.0]))
    np.testing.assert_allclose(per_sample, want)
    # G = 1, ReMax's own setting.
    single, _ = adv_lib.sequence_advantages(config, SCORES[:2], VALID[:2], 1, baselines=np.array([0.0, 1.0]))
    np.testing.assert_allclose(single, [1.0, -1.0])
    with pytest.raises(ValueError, match=r"advantage.estimator='remax'.*baselines"):
        adv_lib.sequence_advantages(config, SCORES, VALID, 3)
    with pytest.raises(ValueError, match=r"baselines has shape \(4,\)"):
        adv_lib.sequence_advantages(config, SCORES, VALID, 3, baselines=np.zeros(4))
    with pytest.raises(ValueError, match="baselines holds non-finite"):
        adv_lib.sequence_advantages(config, SCORES, VALID, 3, baselines=np.array([np.nan, 1.0]))


def test_sequence_advantages_passk_estimators_use_the_config_options():
    scores = np.array([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], np.float32)
    valid = np.ones(8, bool)
    adv, _ = adv_lib.sequence_advantages(adv_lib.AdvantageConfig(estimator="grpo_passk", std_min=0.9), scores, valid, 4)
    # Group 0 has one success: (1 - 0) / max(1/2, 0.9); group 1's best is tied.
    np.testing.assert_allclose(adv, [0, 1 / 0.9, 0, 0, 0, 0, 0, 0], rtol=1e-6)
    adv, _ = adv_lib.sequence_advantages(adv_lib.AdvantageConfig(estimator="passk", passk_k=2), scores, valid, 4)
    want = np.concatenate([_np_passk(scores[:4], 2), _np_passk(scores[4:], 2)])
    np.testing.assert_allclose(adv, want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"advantage.passk_k=5 exceeds the group size 4"):
        adv_lib.sequence_advantages(adv_lib.AdvantageConfig(estimator="passk", passk_k=5), scores, valid, 4)
