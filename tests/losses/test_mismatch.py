"""docs/losses.md#training-inference-mismatch: mismatch metrics against numpy float64,
corrections on hand-made ratios."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import corrections as C
from jaxrl.losses import mismatch as M


def _np_metrics(old, rollout, mask):
    """Independent float64 reference for every key of mismatch_metrics (prefix dropped)."""
    old, rollout, mask = np.float64(old), np.float64(rollout), np.asarray(mask, bool)
    lr = (old - rollout)[mask]
    p, q = np.exp(old[mask]), np.exp(rollout[mask])
    with np.errstate(all="ignore"):  # one-token buckets: correlation undefined, not compared
        pearson = np.corrcoef(p, q)[0, 1] if lr.size > 1 else 0.0
    seqs = [b for b in range(mask.shape[0]) if mask[b].any()]
    mean_old = np.array([old[b][mask[b]].mean() for b in seqs])
    mean_ro = np.array([rollout[b][mask[b]].mean() for b in seqs])
    seq_lr = np.array([(old[b] - rollout[b])[mask[b]].sum() for b in seqs])
    return {
        "k1": np.mean(-lr), "k2": np.mean(0.5 * lr**2), "k3": np.mean(np.exp(lr) - 1 - lr),
        "abs_log_ratio_mean": np.mean(np.abs(lr)), "abs_log_ratio_max": np.max(np.abs(lr)),
        "prob_diff_mean": np.mean(np.abs(p - q)), "prob_pearson": pearson,
        "chi2_token": np.mean(np.exp(lr) ** 2) - 1, "num_tokens": lr.size,
        "ppl_learner": np.mean(np.exp(-mean_old)), "ppl_rollout": np.mean(np.exp(-mean_ro)),
        "log_ppl_diff": np.mean(-mean_old + mean_ro),
        "log_ppl_abs_diff_max": np.max(np.abs(-mean_old + mean_ro)),
        "chi2_seq": np.mean(np.exp(seq_lr) ** 2) - 1, "num_seqs": len(seqs),
    }


def _assert_metrics(got, want, prefix):
    assert set(got) == {prefix + k for k in want}, sorted(got)
    for k, v in want.items():
        np.testing.assert_allclose(got[prefix + k], v, rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    rollout = np.log(rng.uniform(0.05, 1.0, size=(4, 9)))
    old = rollout + rng.normal(0, 0.2, size=(4, 9))
    old = np.minimum(old, 0.0)
    mask = rng.uniform(size=(4, 9)) < 0.7
    mask[3] = False  # a sequence with no policy tokens
    mask[0, :2] = True
    return jnp.asarray(old, jnp.float32), jnp.asarray(rollout, jnp.float32), jnp.asarray(mask)


def test_batch_metrics_match_numpy(batch):
    old, rollout, mask = batch
    got = jax.jit(M.mismatch_metrics)(old, rollout, mask)
    _assert_metrics(got, _np_metrics(old, rollout, mask), "mismatch_")


def test_batch_metrics_hand_values():
    # One sequence, two tokens: learner 0.5 vs rollout 0.25 (r = 2), then 0.5 vs 0.5 (r = 1).
    old = jnp.log(jnp.array([[0.5, 0.5]]))
    rollout = jnp.log(jnp.array([[0.25, 0.5]]))
    got = jax.jit(M.mismatch_metrics)(old, rollout, jnp.ones((1, 2)))
    ln2 = math.log(2)
    np.testing.assert_allclose(got["mismatch_k1"], -ln2 / 2, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_k2"], ln2**2 / 4, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_k3"], (1 - ln2) / 2, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_abs_log_ratio_max"], ln2, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_prob_diff_mean"], 0.125, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_chi2_token"], (4 + 1) / 2 - 1, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_chi2_seq"], 4 - 1, rtol=1e-6)  # sequence ratio 2
    np.testing.assert_allclose(got["mismatch_ppl_learner"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_ppl_rollout"], 1 / math.sqrt(0.125), rtol=1e-6)
    np.testing.assert_allclose(got["mismatch_log_ppl_diff"], -ln2 / 2, rtol=1e-6)
    # Probabilities (0.5, 0.5) are constant: the correlation is reported as 0.
    assert float(got["mismatch_prob_pearson"]) == 0.0


def test_small_mismatch_is_resolved_in_float32():
    # |log_r| ~ 1e-4: k3 ~ 5e-9 and chi2 ~ 2e-4 must not drown in float32 rounding of exp(x) - 1.
    rng = np.random.default_rng(3)
    rollout = np.float32(np.log(rng.uniform(0.1, 0.9, size=(2, 64))))
    old = np.float32(rollout + rng.normal(0, 1e-4, size=(2, 64)))
    mask = np.ones((2, 64), bool)
    got = jax.jit(M.mismatch_metrics)(old, rollout, mask)
    want = _np_metrics(old, rollout, mask)  # float64 on the same float32 inputs
    for key in ("k3", "chi2_token", "chi2_seq", "k2"):
        np.testing.assert_allclose(got[f"mismatch_{key}"], want[key], rtol=1e-3, err_msg=key)


def test_bucketed_by_rollout_prob():
    rollout_p = np.array([[5e-9, 3e-8, 0.5, 0.05, 1.0, 2e-3]])
    rollout = np.log(rollout_p)
    old = rollout + np.array([[0.7, -0.3, 0.1, 0.2, -0.05, 0.4]])
    mask = np.array([[1, 1, 1, 1, 1, 0]], bool)
    got = jax.jit(M.mismatch_metrics_by_rollout_prob)(jnp.float32(old), jnp.float32(rollout), mask)
    edges = np.asarray(M.DEFAULT_PROB_EDGES)
    np.testing.assert_allclose(got["mismatch_bucket_edges"], edges)
    # Buckets: [0,1e-8) <- 5e-9; [1e-8,1e-7) <- 3e-8; [1e-2,0.1) <- 0.05; [0.1,1] <- 0.5 and 1.0;
    # 2e-3 is masked out.
    want_counts = np.zeros(9, int)
    want_counts[[0, 1, 7, 8]] = [1, 1, 1, 2]
    np.testing.assert_array_equal(got["mismatch_bucket_num_tokens"], want_counts)
    members = {0: [0], 1: [1], 7: [3], 8: [2, 4]}
    for bucket, cols in members.items():
        sub = np.zeros_like(mask)
        sub[0, cols] = True
        want = _np_metrics(old, rollout, sub)
        for key in ("k1", "k2", "k3", "abs_log_ratio_mean", "abs_log_ratio_max", "prob_diff_mean", "chi2_token"):
            np.testing.assert_allclose(got[f"mismatch_bucket_{key}"][bucket], want[key], rtol=2e-5,
                                       atol=1e-7, err_msg=f"{key} bucket {bucket}")
    for key in ("k3", "prob_pearson", "abs_log_ratio_max"):
        empty = np.flatnonzero(want_counts == 0)
        np.testing.assert_array_equal(np.asarray(got[f"mismatch_bucket_{key}"])[empty], 0.0)
    # Two tokens in [0.1, 1]: correlation of two points is +-1.
    np.testing.assert_allclose(got["mismatch_bucket_prob_pearson"][8], 1.0, rtol=1e-5)

    # Custom edges; probabilities outside [edges[0], edges[-1]] fall in no bucket.
    by_prob = jax.jit(lambda o, r, m: M.mismatch_metrics_by_rollout_prob(o, r, m, edges=(1e-8, 0.1, 0.6)))
    got = by_prob(jnp.float32(old), jnp.float32(rollout), mask)
    np.testing.assert_array_equal(got["mismatch_bucket_num_tokens"], [2, 1])


def test_split_by_turn(batch):
    old, rollout, mask = batch
    # Sequence 0 starts its model turns at id 1; sequence 1 at id 0; sequence 2 has one turn.
    turn_ids = np.zeros((4, 9), np.int32)
    turn_ids[0] = [0, 1, 1, 1, 2, 2, 3, 3, 3]
    turn_ids[0, 0] = 1
    turn_ids[1, 5:] = 2
    turn_ids[2] = 5
    got = jax.jit(M.mismatch_metrics_by_turn)(old, rollout, mask, jnp.asarray(turn_ids))
    m = np.asarray(mask)
    first = m & (turn_ids == np.array([1, 0, 5, 0])[:, None])
    _assert_metrics({k: v for k, v in got.items() if k.startswith("first_turn_")},
                    _np_metrics(old, rollout, first), "first_turn_")
    _assert_metrics({k: v for k, v in got.items() if k.startswith("later_turns_")},
                    _np_metrics(old, rollout, m & ~first), "later_turns_")


# --------------------------------------------------------------------------- #
# Corrections on hand-made ratios
# --------------------------------------------------------------------------- #
def _from_ratios(ratios, mask):
    """old/rollout logprobs whose token ratios exp(old - rollout) are ``ratios``."""
    rollout = np.full(np.shape(ratios), math.log(0.3))
    return jnp.float32(rollout + np.log(ratios)), jnp.float32(rollout), jnp.asarray(mask)


RATIOS = np.array([[0.5, 1.0, 3.0, 7.0], [0.4, 1.5, 2.0, 1.0]])
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)


def test_token_tis():
    weight, keep, metrics = jax.jit(C.token_tis)(*_from_ratios(RATIOS, MASK))
    np.testing.assert_allclose(weight, [[0.5, 1.0, 2.0, 0.0], [0.4, 1.5, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(keep, MASK)
    np.testing.assert_allclose(metrics["token_tis_clipped_token_frac"], 1 / 5)
    np.testing.assert_allclose(metrics["token_tis_clipped_seq_frac"], 1 / 2)
    np.testing.assert_allclose(metrics["token_tis_weight_mean"], (0.5 + 1 + 2 + 0.4 + 1.5) / 5, rtol=1e-6)


def test_sequence_tis():
    # Sequence ratios: 0.5 * 1 * 3 = 1.5 and 0.4 * 1.5 = 0.6; cap 1.2 clips the first.
    sequence_tis = jax.jit(C.sequence_tis, static_argnames="cap")
    weight, keep, metrics = sequence_tis(*_from_ratios(RATIOS, MASK), cap=1.2)
    np.testing.assert_allclose(weight, [[1.2, 1.2, 1.2, 0.0], [0.6, 0.6, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(keep, MASK)
    np.testing.assert_allclose(metrics["seq_tis_clipped_token_frac"], 3 / 5)
    np.testing.assert_allclose(metrics["seq_tis_clipped_seq_frac"], 1 / 2)
    # Default cap 2: nothing clipped; a 1000-token sequence with ratio e per token does not overflow.
    weight, _, _ = sequence_tis(*_from_ratios(RATIOS, MASK))
    np.testing.assert_allclose(weight[:, 0], [1.5, 0.6], rtol=1e-6)
    long = sequence_tis(jnp.zeros((1, 1000)), -jnp.ones((1, 1000)), jnp.ones((1, 1000)))[0]
    np.testing.assert_allclose(long, 2.0)


def test_token_mis_icepop_two_sided():
    ratios = np.array([[0.49, 0.51, 4.9, 5.1, 1.0, 9.0]])
    mask = np.array([[1, 1, 1, 1, 1, 0]], bool)
    weight, keep, metrics = C.token_mis(*_from_ratios(ratios, mask))  # band [1/2, 5]
    np.testing.assert_array_equal(keep, [[False, True, True, False, True, False]])
    np.testing.assert_allclose(weight, [[0, 0.51, 4.9, 0, 1.0, 0]], rtol=1e-6)
    np.testing.assert_allclose(metrics["token_mis_masked_token_frac"], 2 / 5)
    np.testing.assert_allclose(metrics["token_mis_masked_seq_frac"], 1.0)
    _, keep, _ = C.token_mis(*_from_ratios(ratios, mask), c_low=10.0, c_high=2.0)
    np.testing.assert_array_equal(keep, [[True, True, False, False, True, False]])


def test_sequence_mis_masks_whole_sequence():
    # Sequence ratios 1.5 and 0.6; cap 1.2 masks sequence 0 entirely.
    weight, keep, metrics = C.sequence_mis(*_from_ratios(RATIOS, MASK), cap=1.2)
    np.testing.assert_array_equal(keep, [[False] * 4, [True, True, False, False]])
    np.testing.assert_allclose(weight, [[0.0] * 4, [0.6, 0.6, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(metrics["seq_mis_masked_token_frac"], 3 / 5)
    np.testing.assert_allclose(metrics["seq_mis_masked_seq_frac"], 1 / 2)


def test_geo_rs_is_length_invariant():
    ratios = np.array([
        [1.0005, 1.0005, 1.0, 1.0],      # 2 tokens, geometric mean 1.0005: kept
        [1.003, 1.0, 1.0, 1.0],          # 2 tokens, sqrt(1.003) = 1.0015: rejected
        [1.0008, 1.0008, 1.0008, 1.0008],  # sequence ratio 1.0032 but per token 1.0008: kept
        [0.997, 0.9995, 1.0, 1.0],       # 2 tokens, geometric mean 0.99825: rejected (lower side)
    ])
    mask = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], bool)
    weight, keep, metrics = jax.jit(C.geo_rs)(*_from_ratios(ratios, mask))
    want = mask & np.array([True, False, True, False])[:, None]
    np.testing.assert_array_equal(keep, want)
    np.testing.assert_array_equal(weight, want.astype(np.float32))
    np.testing.assert_allclose(metrics["geo_rs_masked_token_frac"], 4 / 10)
    np.testing.assert_allclose(metrics["geo_rs_masked_seq_frac"], 2 / 4)


def test_batch_filter_skips_above_threshold(batch):
    old, rollout, mask = batch
    k3 = _np_metrics(old, rollout, mask)["k3"]
    skip, metrics = jax.jit(lambda *a: M.batch_filter(*a, threshold=k3 * 1.01))(old, rollout, mask)
    assert not bool(skip) and int(metrics["batch_filter_skip"]) == 0
    np.testing.assert_allclose(metrics["batch_filter_value"], k3, rtol=2e-5)
    skip, metrics = jax.jit(lambda *a: M.batch_filter(*a, threshold=k3 * 0.99))(old, rollout, mask)
    assert bool(skip) and int(metrics["batch_filter_skip"]) == 1
    skip, _ = jax.jit(lambda *a: M.batch_filter(*a, threshold=0.5, metric="mismatch_abs_log_ratio_max"))(
        old, rollout, mask)
    assert bool(skip) == (_np_metrics(old, rollout, mask)["abs_log_ratio_max"] > 0.5)


# --------------------------------------------------------------------------- #
# Masks and bad input
# --------------------------------------------------------------------------- #
def test_masked_tokens_change_nothing(batch):
    old, rollout, mask = batch
    turn_ids = jnp.asarray(np.arange(36).reshape(4, 9) // 3, jnp.int32)
    off = ~np.asarray(mask)
    poked_old = jnp.where(off, -jnp.inf, old)
    poked_rollout = jnp.where(off, jnp.nan, rollout)
    poked_turns = jnp.where(off, -5, turn_ids)

    def everything(o, r, t):
        return (M.mismatch_metrics(o, r, mask), M.mismatch_metrics_by_rollout_prob(o, r, mask),
                M.mismatch_metrics_by_turn(o, r, mask, t), C.token_tis(o, r, mask), C.sequence_tis(o, r, mask),
                C.token_mis(o, r, mask), C.sequence_mis(o, r, mask), C.geo_rs(o, r, mask, lower=0.8, upper=1.2),
                M.batch_filter(o, r, mask, threshold=0.01))

    run = jax.jit(everything)
    base, poked = run(old, rollout, turn_ids), run(poked_old, poked_rollout, poked_turns)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(poked), strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(base[:3]))


def test_bad_input_names_the_argument():
    x, mask = jnp.zeros((2, 3)), jnp.ones((2, 3))
    with pytest.raises(ValueError, match="rollout_logp"):
        M.mismatch_metrics(x, jnp.zeros((2, 4)), mask)
    with pytest.raises(ValueError, match="old_logp"):
        C.token_tis(jnp.zeros((2, 3), jnp.int32), x, mask)
    with pytest.raises(ValueError, match="mask"):
        C.sequence_mis(x, x, jnp.ones((3,)))
    with pytest.raises(ValueError, match="turn_ids"):
        M.mismatch_metrics_by_turn(x, x, mask, jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="edges"):
        M.mismatch_metrics_by_rollout_prob(x, x, mask, edges=(0.5, 0.1))
    with pytest.raises(ValueError, match="cap"):
        C.sequence_tis(x, x, mask, cap=0.0)
    with pytest.raises(ValueError, match="c_low"):
        C.token_mis(x, x, mask, c_low=0.5, c_high=1.5)
    with pytest.raises(ValueError, match="lower"):
        C.geo_rs(x, x, mask, lower=1.1, upper=1.0)
    with pytest.raises(ValueError, match="metric"):
        M.batch_filter(x, x, mask, threshold=1.0, metric="vllm_kl")
