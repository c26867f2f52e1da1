"""Advantage estimators against the figures of docs/losses.md#grpo-and-the-std-clip and hand-written numpy loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import losses
from jaxrl.losses import advantages as adv_lib

REWARDS = np.array([[1.0, 0.0, 0.5, 0.25], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 1.0, -1.0]], np.float32)


def test_spec_std_clip_example():
    r = jnp.array([[0.99999, 1.00001, 0.99999, 1.00001]])
    plain, _ = adv_lib.grpo_advantages(r, std_min=1e-12, ddof=1)
    # Sample std of +-1e-5 over 4 samples is 1e-5*sqrt(4/3): A = +-sqrt(3)/2.
    np.testing.assert_allclose(plain[0], np.sqrt(3) / 2 * np.array([-1, 1, -1, 1]), rtol=2e-2)
    clipped, _ = adv_lib.grpo_advantages(r, std_min=0.1, ddof=1)
    np.testing.assert_allclose(clipped[0], 1e-4 * np.array([-1, 1, -1, 1]), rtol=2e-2)


def _np_grpo(rows, ddof, std_min, std_max=np.inf):
    out = []
    for row in rows:
        std = np.std(row, ddof=ddof) if len(row) > ddof else 0.0
        out.append((row - row.mean()) / np.clip(std, std_min, std_max))
    return out


@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo_matches_numpy_in_all_three_layouts(ddof):
    expected = np.stack(_np_grpo(REWARDS, ddof, 0.1, 5.0))
    grid, metrics = adv_lib.grpo_advantages(jnp.asarray(REWARDS), std_min=0.1, std_max=5.0, ddof=ddof)
    np.testing.assert_allclose(grid, expected, rtol=1e-5, atol=1e-6)
    assert int(metrics["zero_variance_groups"]) == 1
    flat, _ = adv_lib.grpo_advantages(jnp.asarray(REWARDS.reshape(-1)), group_size=4, std_min=0.1, std_max=5.0,
                                      ddof=ddof)
    np.testing.assert_allclose(flat, expected.reshape(-1), rtol=1e-5, atol=1e-6)
    # Shuffled order with explicit ids and one unused id.
    perm = np.random.default_rng(0).permutation(12)
    ids = np.repeat(np.arange(3), 4)[perm]
    shuffled, m = adv_lib.grpo_advantages(
        jnp.asarray(REWARDS.reshape(-1)[perm]), group_ids=jnp.asarray(ids), num_groups=4,
        std_min=0.1, std_max=5.0, ddof=ddof,
    )
    np.testing.assert_allclose(shuffled, expected.reshape(-1)[perm], rtol=1e-5, atol=1e-6)
    assert int(m["zero_variance_groups"]) == 1


def test_grpo_unequal_group_sizes_with_ids():
    r = np.array([1.0, 0.0, 3.0, 1.0, 2.0, 7.0], np.float32)
    ids = np.array([0, 0, 1, 1, 1, 2])
    got, m = adv_lib.grpo_advantages(jnp.asarray(r), group_ids=jnp.asarray(ids), num_groups=3, std_min=0.1)
    expected = np.concatenate(_np_grpo([r[:2], r[2:5], r[5:]], 1, 0.1))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert int(m["zero_variance_groups"]) == 1  # the singleton group


def test_dr_grpo_rloo_reinforce_against_numpy():
    dr, _ = adv_lib.dr_grpo_advantages(jnp.asarray(REWARDS))
    np.testing.assert_allclose(dr, REWARDS - REWARDS.mean(1, keepdims=True), atol=1e-6)

    loo = np.zeros_like(REWARDS)
    for g, row in enumerate(REWARDS):
        for i in range(4):
            loo[g, i] = row[i] - np.mean(np.delete(row, i))
    rloo, m = adv_lib.rloo_advantages(jnp.asarray(REWARDS))
    np.testing.assert_allclose(rloo, loo, atol=1e-6)
    assert int(m["zero_variance_groups"]) == 1

    flat = REWARDS.reshape(-1)
    rf, _ = adv_lib.reinforce_advantages(jnp.asarray(flat))
    np.testing.assert_allclose(rf, (flat - flat.mean()) / flat.std(), rtol=1e-5, atol=1e-6)

    centred = REWARDS - REWARDS.mean(1, keepdims=True)
    expected = (centred - centred.mean()) / centred.std()
    rpp, m = adv_lib.reinforce_pp_baseline_advantages(jnp.asarray(flat), group_size=4)
    np.testing.assert_allclose(rpp, expected.reshape(-1), rtol=1e-5, atol=1e-6)
    assert int(m["zero_variance_groups"]) == 1


def _np_gae(rewards, values, mask, gamma, lam):
    out = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        adv_next, v_next = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t] + gamma * v_next - values[b, t]
            adv_next = delta + gamma * lam * adv_next
            v_next = values[b, t]
            out[b, t] = adv_next
    return out


def test_gae_against_numpy_loop_with_holes_in_mask():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(3, 7)).astype(np.float32)
    values = rng.normal(size=(3, 7)).astype(np.float32)
    mask = np.array([[0, 1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]], bool)
    adv, ret = losses.gae_advantages(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=0.9, lam=0.7)
    expected = _np_gae(rewards, values, mask, 0.9, 0.7)
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, np.where(mask, expected + values, 0.0), rtol=1e-5, atol=1e-6)
    # gamma = lam = 1 and zero values: the advantage is the reward-to-go.
    adv1, _ = losses.gae_advantages(jnp.asarray(rewards), jnp.zeros((3, 7)), jnp.asarray(mask), gamma=1.0, lam=1.0)
    togo = np.where(mask, np.cumsum((rewards * mask)[:, ::-1], axis=1)[:, ::-1], 0.0)
    np.testing.assert_allclose(adv1, togo, rtol=1e-5, atol=1e-5)


def test_broadcast_and_jit():
    mask = jnp.array([[1, 1, 0], [0, 1, 1]])
    out = losses.broadcast_to_tokens(jnp.array([2.0, -1.0]), mask)
    np.testing.assert_array_equal(out, [[2, 2, 0], [0, -1, -1]])
    jitted = jax.jit(lambda r: adv_lib.grpo_advantages(r, group_size=4)[0])
    np.testing.assert_allclose(jitted(jnp.asarray(REWARDS.reshape(-1))),
                               np.stack(_np_grpo(REWARDS, 1, 0.1)).reshape(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda: adv_lib.grpo_advantages(jnp.ones(6), group_size=4), ["group_size=4", "6"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones(6, jnp.int32), group_size=3), ["rewards", "int32"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones(6), group_ids=jnp.zeros(6), num_groups=1), ["group_ids", "float32"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones(6), group_ids=jnp.zeros(5, jnp.int32), num_groups=1),
         ["group_ids", "(5,)", "(6,)"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones(6), group_ids=jnp.zeros(6, jnp.int32)), ["num_groups"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones(6)), ["group_size", "group_ids"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones((2, 3)), std_min=1.0, std_max=0.5), ["std_min", "std_max"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones((2, 3)), std_min=0.0), ["std_min"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones((2, 3)), ddof=2), ["ddof"]),
        (lambda: adv_lib.grpo_advantages(jnp.ones((2, 3, 1))), ["rewards", "rank 3"]),
        (lambda: losses.gae_advantages(jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((2, 3))), ["values", "(2, 4)"]),
        (lambda: losses.gae_advantages(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3)), gamma=1.5), ["gamma"]),
        (lambda: adv_lib.broadcast_to_tokens(jnp.ones(3), jnp.ones((2, 4))), ["sequence_values", "mask"]),
    ],
)
def test_bad_input_names_the_argument(call, names):
    with pytest.raises(ValueError) as err:
        call()
    for name in names:
        assert name in str(err.value)


# --------------------------------------------------------------------------- #
# Masked samples (unparsable responses) enter no statistic
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("x", [0.0, 1.0, 100.0, float("nan")])
def test_reinforce_mask_leaves_invalid_sample_out_of_batch_statistics(x):
    # Valid rewards [1, 0, 1, 0]: mean 1/2, population std 1/2 -> A = (r - 1/2) / (1/2) = [1, -1, 1, -1].
    rewards = jnp.array([1.0, 0.0, 1.0, 0.0, x])
    mask = jnp.array([True, True, True, True, False])
    adv, metrics = adv_lib.reinforce_advantages(rewards, mask=mask)
    np.testing.assert_allclose(adv, [1.0, -1.0, 1.0, -1.0, 0.0], rtol=1e-6)
    assert int(metrics["zero_variance_groups"]) == 0
    # The same as the estimator on the valid subset alone.
    subset, _ = adv_lib.reinforce_advantages(rewards[:4])
    np.testing.assert_allclose(adv[:4], subset, rtol=1e-6)


@pytest.mark.parametrize("x", [0.0, 1.0, 100.0])
def test_reinforce_pp_baseline_mask_leaves_invalid_sample_out_of_group_and_batch(x):
    # Two groups of 3; sample 2 is invalid. Group baselines over valid samples:
    # [1, 0] -> 1/2, centred [1/2, -1/2]; [0, 1, 1] -> 2/3, centred [-2/3, 1/3, 1/3].
    # Batch over the 5 centred values: mean 0, population variance (1/4 + 1/4 + 4/9 + 1/9 + 1/9) / 5 = 7/30.
    rewards = jnp.array([1.0, 0.0, x, 0.0, 1.0, 1.0])
    mask = jnp.array([1, 1, 0, 1, 1, 1])
    adv, metrics = adv_lib.reinforce_pp_baseline_advantages(rewards, group_size=3, mask=mask)
    centred = np.array([0.5, -0.5, 0.0, -2 / 3, 1 / 3, 1 / 3])
    np.testing.assert_allclose(adv, centred / np.sqrt(7 / 30), rtol=1e-5, atol=1e-6)
    assert int(metrics["zero_variance_groups"]) == 0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_masked_group_estimators_equal_the_estimator_on_the_valid_samples(name):
    fn = adv_lib.ADVANTAGE_ESTIMATORS[name]
    rewards = jnp.asarray(REWARDS)
    mask = jnp.array([[1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0]], bool)
    adv, metrics = fn(rewards, mask=mask)
    live = np.asarray(mask).reshape(-1)
    ids = np.repeat(np.arange(3), 4)[live]
    subset, subset_metrics = fn(rewards.reshape(-1)[live], group_ids=jnp.asarray(ids), num_groups=3)
    np.testing.assert_allclose(np.asarray(adv).reshape(-1)[live], subset, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv)[~np.asarray(mask)], 0.0)
    assert int(metrics["zero_variance_groups"]) == int(subset_metrics["zero_variance_groups"]) == 1
    # Whatever the masked samples hold, nothing changes.
    poked, _ = fn(jnp.where(mask, rewards, 1e3), mask=mask)
    np.testing.assert_array_equal(poked, adv)


def test_zero_variance_groups_count_valid_samples_only():
    # Group 0's valid rewards agree (the invalid 0 must not make it informative); group 2 has no valid sample.
    rewards = jnp.array([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [3.0, 4.0, 5.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    adv, metrics = adv_lib.grpo_advantages(rewards, mask=mask)
    assert int(metrics["zero_variance_groups"]) == 1
    np.testing.assert_array_equal(adv[0], [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(adv[2], [0.0, 0.0, 0.0])


def test_mask_must_match_rewards():
    with pytest.raises(ValueError, match=r"mask has shape \(5,\)"):
        adv_lib.grpo_advantages(jnp.ones(6), group_size=3, mask=jnp.ones(5))
    with pytest.raises(ValueError, match="mask"):
        adv_lib.reinforce_advantages(jnp.ones(4), mask=jnp.ones((2, 2)))


# --------------------------------------------------------------------------- #
# AdvantageConfig and sequence_advantages (the trainer's entry point)
# --------------------------------------------------------------------------- #
def test_advantage_config_choices_are_the_registry():
    import typing

    hints = typing.get_type_hints(adv_lib.AdvantageConfig)
    assert typing.get_args(hints["estimator"]) == adv_lib.ESTIMATOR_CHOICES
    assert adv_lib.ESTIMATOR_CHOICES == (*adv_lib.ADVANTAGE_ESTIMATORS, *adv_lib.TOKEN_ADVANTAGE_ESTIMATORS)
    assert adv_lib.TOKEN_ADVANTAGE_ESTIMATORS == {"gae": losses.gae_advantages}
    assert not set(adv_lib.TOKEN_ADVANTAGE_ESTIMATORS) & set(adv_lib.ADVANTAGE_ESTIMATORS)
    assert adv_lib.AdvantageConfig(estimator="gae").needs_critic and not adv_lib.AdvantageConfig().needs_critic
    assert set(adv_lib.AdvantageConfig.GROUPED) < set(adv_lib.ADVANTAGE_ESTIMATORS)
    assert "reinforce" not in adv_lib.AdvantageConfig.GROUPED


def test_advantage_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"advantage.std_min \(0.0\) must be > 0 and <= advantage.std_max"):
        adv_lib.AdvantageConfig(std_min=0.0)
    with pytest.raises(ValueError, match=r"advantage.std_min \(2.0\).*advantage.std_max \(1.0\)"):
        adv_lib.AdvantageConfig(std_min=2.0, std_max=1.0)
    with pytest.raises(ValueError, match="advantage.estimator='ppo'.*'grpo'.*'gae'"):
        adv_lib.AdvantageConfig(estimator="ppo")
    for name, bad in (("gamma", 1.5), ("lam", -0.1), ("lam", True)):
        with pytest.raises(ValueError, match=rf"advantage.{name}={bad!r} must be a number in \[0, 1\]"):
            adv_lib.AdvantageConfig(estimator="gae", **{name: bad})
    with pytest.raises(ValueError, match="advantage.estimator='gae' is token-level.*gae_advantages"):
        adv_lib.sequence_advantages(adv_lib.AdvantageConfig(estimator="gae"), np.ones(4, np.float32),
                                    np.ones(4, bool), 2)


def test_sequence_advantages_grpo_leaves_invalid_samples_out():
    # Two prompts, G = 3; sample 2 is invalid. GRPO with the sample std (ddof=1):
    # group 0 over its valid [1, 0]: mean 1/2, std sqrt(1/2) -> +-1/sqrt(2);
    # group 1 [0, 1, 1]: mean 2/3, std sqrt(1/3) -> (r - 2/3) * sqrt(3).
    scores = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], np.float32)
    valid = np.array([True, True, False, True, True, True])
    adv, metrics = adv_lib.sequence_advantages(adv_lib.AdvantageConfig(), scores, valid, 3)
    s = np.sqrt(3.0)
    assert adv.dtype == np.float32 and adv.shape == (6,)
    np.testing.assert_allclose(adv, [1 / np.sqrt(2), -1 / np.sqrt(2), 0.0, -2 / 3 * s, 1 / 3 * s, 1 / 3 * s],
                               rtol=1e-6)
    assert metrics == {"advantage/zero_variance_group_fraction": 0.0}
    scores[1] = 1.0  # group 0's valid samples now agree
    adv, metrics = adv_lib.sequence_advantages(adv_lib.AdvantageConfig(), scores, valid, 3)
    np.testing.assert_array_equal(adv[:3], [0.0, 0.0, 0.0])
    assert metrics == {"advantage/zero_variance_group_fraction": 0.5}


@pytest.mark.parametrize("x", [0.0, 1.0, 7.0])
def test_sequence_advantages_batch_estimators_leave_invalid_samples_out(x):
    valid = np.array([True, True, False, True, True, True])
    # reinforce: valid [1, 0, 0, 1, 1] has mean 3/5 and population std sqrt(6/25) = sqrt(6)/5.
    scores = np.array([1.0, 0.0, x, 0.0, 1.0, 1.0], np.float32)
    adv, metrics = adv_lib.sequence_advantages(adv_lib.AdvantageConfig(estimator="reinforce"), scores, valid, 3)
    want = np.where(valid, (scores - 0.6) / (np.sqrt(6.0) / 5), 0.0)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert metrics == {"advantage/zero_variance_group_fraction": 0.0}
    # reinforce_pp_baseline: the centred values of the test above over a batch std of sqrt(7/30).
    config = adv_lib.AdvantageConfig(estimator="reinforce_pp_baseline")
    adv, _ = adv_lib.sequence_advantages(config, scores, valid, 3)
    centred = np.array([0.5, -0.5, 0.0, -2 / 3, 1 / 3, 1 / 3])
    np.testing.assert_allclose(adv, centred / np.sqrt(7 / 30), rtol=1e-5, atol=1e-6)
