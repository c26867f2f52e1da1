"""Sequence k2/k3 rejection, IS weight batch normalisation, seq-MIS's lower bound and combined
corrections (docs/losses.md#mismatch-corrections), against numpy closed forms on hand-made batches."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import corrections as C

# Token log ratios log_r = old_logp - rollout_logp (learner minus rollout); row 3 is all padding.
LOG_R = np.array([
    [0.1, -0.1, 0.0, 0.0],
    [0.5, 0.0, 0.0, 0.0],
    [0.2, 0.2, 0.2, 0.3],
    [0.0, 0.0, 0.0, 0.0],
], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)


def _pair(log_r, mask, junk=True):
    """(old_logp, rollout_logp, mask) with old - rollout = log_r; junk (-inf / nan) off the mask."""
    rollout = np.full(log_r.shape, -1.0, np.float32)
    old = rollout + log_r
    if junk:
        old = np.where(mask, old, -np.inf).astype(np.float32)
        rollout = np.where(mask, rollout, np.nan).astype(np.float32)
    return jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(mask)


def _np_sequence_stat(log_r, mask, estimator, aggregate):
    x = log_r.astype(np.float64)
    k = 0.5 * x**2 if estimator == "k2" else np.expm1(x) - x
    stats = []
    for row, m in zip(k, mask, strict=True):
        vals = row[m]
        if vals.size == 0:
            stats.append(0.0)
        else:
            stats.append({"sum": vals.sum(), "mean": vals.mean(), "max": vals.max()}[aggregate])
    return np.array(stats)


# --------------------------------------------------------------------------- #
# Sequence k2 / k3 rejection
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("estimator", ["k2", "k3"])
@pytest.mark.parametrize("aggregate", ["sum", "mean", "max"])
def test_sequence_kl_rs_against_numpy(estimator, aggregate):
    stat = _np_sequence_stat(LOG_R, MASK, estimator, aggregate)
    threshold = float(np.sort(stat[:3])[1])  # just above the middle sequence: it is kept, the largest rejected
    threshold *= 1.0 + 1e-4
    weight, keep, metrics = jax.jit(lambda *a: C.sequence_kl_rs(
        *a, estimator=estimator, aggregate=aggregate, threshold=threshold))(*_pair(LOG_R, MASK))
    kept_seq = stat <= threshold
    want = MASK & kept_seq[:, None]
    assert want.sum() > 0 and (MASK & ~want).sum() > 0  # one sequence rejected, two kept
    np.testing.assert_array_equal(keep, want)
    np.testing.assert_array_equal(weight, want.astype(np.float32))
    rejected = MASK & ~want
    np.testing.assert_allclose(metrics["seq_kl_rs_masked_token_frac"], rejected.sum() / MASK.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["seq_kl_rs_masked_seq_frac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(metrics["seq_kl_rs_value_mean"], stat[:3].mean(), rtol=1e-5)


def test_sequence_kl_rs_thresholds_by_hand():
    # k2 of log_r 0.5 is exactly 0.125 in float32: "exceeds" is strict, as verl's keep = stat <= threshold.
    _, keep, _ = C.sequence_kl_rs(*_pair(LOG_R, MASK), estimator="k2", aggregate="max", threshold=0.125)
    np.testing.assert_array_equal(keep.any(-1), [True, True, True, False])
    _, keep, _ = C.sequence_kl_rs(*_pair(LOG_R, MASK), estimator="k2", aggregate="max", threshold=0.12)
    np.testing.assert_array_equal(keep.any(-1), [True, False, True, False])
    # Sum versus mean: row 2's k2 sum is (3 * 0.04 + 0.09) / 2 = 0.105, its mean 0.02625.
    _, keep, _ = C.sequence_kl_rs(*_pair(LOG_R, MASK), estimator="k2", aggregate="sum", threshold=0.1)
    np.testing.assert_array_equal(keep.any(-1), [True, False, False, False])
    _, keep, _ = C.sequence_kl_rs(*_pair(LOG_R, MASK), estimator="k2", aggregate="mean", threshold=0.03)
    np.testing.assert_array_equal(keep.any(-1), [True, False, True, False])


def test_sequence_kl_rs_padding_never_rejects():
    # Huge ratios on padded tokens: the same result as a clean batch.
    dirty = np.where(MASK, LOG_R, 50.0).astype(np.float32)
    clean = C.sequence_kl_rs(*_pair(LOG_R, MASK, junk=False), threshold=0.01)
    for junk in (True, False):
        poked = C.sequence_kl_rs(*_pair(dirty, MASK, junk=junk), threshold=0.01)
        for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(poked), strict=True):
            np.testing.assert_array_equal(a, b)
    # An empty sequence is neither kept nor counted as rejected.
    assert not np.asarray(clean[1])[3].any()


def test_sequence_kl_rs_overflow_rejects():
    log_r = np.array([[100.0, 0.0]], np.float32)  # exp overflows float32: k3 = +inf
    weight, keep, metrics = C.sequence_kl_rs(*_pair(log_r, np.ones((1, 2), bool)), aggregate="mean")
    np.testing.assert_array_equal(keep, [[False, False]])
    np.testing.assert_array_equal(weight, [[0.0, 0.0]])
    assert float(metrics["seq_kl_rs_masked_seq_frac"]) == 1.0


# --------------------------------------------------------------------------- #
# Batch normalisation
# --------------------------------------------------------------------------- #
WEIGHT = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 4.0, 7.0, 7.0], [0.5, 0.5, 0.5, 0.5], [5.0, 5.0, 5.0, 5.0]],
                  np.float32)


def test_batch_normalize_token_level():
    mean = WEIGHT[MASK].mean()  # (1 + 2 + 3 + 4 + 4 + 0.5 * 4) / 9
    out, metrics = jax.jit(C.batch_normalize_is_weights)(jnp.asarray(WEIGHT), jnp.asarray(MASK))
    np.testing.assert_allclose(out, np.where(MASK, WEIGHT / mean, 0.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out)[MASK].mean(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(metrics["is_batch_norm_factor"], mean, rtol=1e-6)


def test_batch_normalize_sequence_level_counts_each_sequence_once():
    seq_weight = np.array([2.0, 4.0, 0.5])  # per-sequence weights, broadcast over tokens
    weight = np.where(MASK, np.concatenate([seq_weight, [5.0]])[:, None], 0.0).astype(np.float32)
    out, metrics = C.batch_normalize_is_weights(jnp.asarray(weight), jnp.asarray(MASK), level="sequence")
    mean = seq_weight.mean()  # 6.5 / 3, not the token mean (6 + 8 + 2) / 9
    np.testing.assert_allclose(metrics["is_batch_norm_factor"], mean, rtol=1e-6)
    np.testing.assert_allclose(out, weight / mean, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out)[:3, 0].mean(), 1.0, rtol=1e-6)
    # Token level would have used the token mean.
    _, token = C.batch_normalize_is_weights(jnp.asarray(weight), jnp.asarray(MASK))
    np.testing.assert_allclose(token["is_batch_norm_factor"], 16 / 9, rtol=1e-6)


def test_batch_normalize_with_given_mean_and_degenerate_mean():
    out, metrics = C.batch_normalize_is_weights(jnp.asarray(WEIGHT), jnp.asarray(MASK), batch_mean=2.0)
    np.testing.assert_allclose(out, np.where(MASK, WEIGHT / 2.0, 0.0), rtol=1e-6)
    assert float(metrics["is_batch_norm_factor"]) == 2.0
    # All weights zero (every token rejected): left as they are, factor 1 (verl's 1e-8 guard).
    out, metrics = C.batch_normalize_is_weights(jnp.zeros((2, 3)), jnp.ones((2, 3)))
    np.testing.assert_array_equal(out, np.zeros((2, 3)))
    assert float(metrics["is_batch_norm_factor"]) == 1.0


def test_batch_normalize_is_detached_and_ignores_padding():
    dirty = np.where(MASK, WEIGHT, np.nan).astype(np.float32)
    out, _ = C.batch_normalize_is_weights(jnp.asarray(dirty), jnp.asarray(MASK))
    clean, _ = C.batch_normalize_is_weights(jnp.asarray(WEIGHT), jnp.asarray(MASK))
    np.testing.assert_array_equal(out, clean)
    grad = jax.grad(lambda w: jnp.sum(C.batch_normalize_is_weights(w, jnp.asarray(MASK))[0]))(jnp.asarray(WEIGHT))
    np.testing.assert_array_equal(grad, np.zeros_like(WEIGHT))


# --------------------------------------------------------------------------- #
# Sequence MIS with a lower bound
# --------------------------------------------------------------------------- #
def _np_sequence_mis(log_r, mask, cap, lower=None):
    seq = np.exp(np.where(mask, log_r, 0.0).astype(np.float64).sum(-1))
    inside = seq <= cap
    if lower is not None:
        inside &= seq >= lower
    keep = mask & inside[:, None]
    return np.where(keep, np.minimum(seq, cap)[:, None], 0.0), keep


def test_sequence_mis_default_is_todays_one_sided_form():
    # Sequence ratios: e^0 = 1, e^0.5 = 1.65, e^0.9 = 2.46.
    for cap in (2.0, 1.2):
        want_w, want_keep = _np_sequence_mis(LOG_R, MASK, cap)
        default = C.sequence_mis(*_pair(LOG_R, MASK), cap=cap)
        explicit = C.sequence_mis(*_pair(LOG_R, MASK), cap=cap, lower=None)
        for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(explicit), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(default[0], want_w, rtol=1e-6)
        np.testing.assert_array_equal(default[1], want_keep)
        assert set(default[2]) == {"seq_mis_masked_token_frac", "seq_mis_masked_seq_frac", "seq_mis_weight_mean"}


def test_sequence_mis_two_sided_band():
    log_r = np.array([[-0.5, 0.0], [-0.1, 0.0], [0.3, 0.0], [0.9, 0.0]], np.float32)  # ratios .61 .90 1.35 2.46
    mask = np.array([[1, 0], [1, 1], [1, 1], [1, 1]], bool)
    weight, keep, metrics = jax.jit(lambda *a: C.sequence_mis(*a, cap=2.0, lower=0.8))(*_pair(log_r, mask))
    want_w, want_keep = _np_sequence_mis(log_r, mask, 2.0, 0.8)
    np.testing.assert_array_equal(keep, want_keep)
    np.testing.assert_array_equal(np.asarray(keep).any(-1), [False, True, True, False])
    np.testing.assert_allclose(weight, want_w, rtol=1e-6)
    np.testing.assert_allclose(metrics["seq_mis_masked_token_frac"], 3 / 7, rtol=1e-6)
    np.testing.assert_allclose(metrics["seq_mis_masked_seq_frac"], 2 / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["seq_mis_weight_mean"], (2 * math.exp(-0.1) + 2 * math.exp(0.3)) / 4,
                               rtol=1e-6)


# --------------------------------------------------------------------------- #
# Combined corrections
# --------------------------------------------------------------------------- #
def test_seq_tis_with_token_mis_rejection():
    log_r = np.log(np.array([[1.5, 1.0, 0.4, 1.0], [0.9, 6.0, 1.0, 1.0]], np.float32))
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    data = _pair(log_r, mask)
    weight, keep, metrics = jax.jit(lambda *a: C.combine_corrections(
        C.sequence_tis(*a, cap=2.0), C.token_mis(*a, c_low=2.0, c_high=5.0)))(*data)
    seq_ratio = np.array([1.5 * 0.4, 0.9 * 6.0])  # 0.6 and 5.4 -> truncated weights 0.6, 2
    token_ok = (np.exp(log_r) >= 0.5) & (np.exp(log_r) <= 5.0)
    want_keep = mask & token_ok
    np.testing.assert_array_equal(keep, want_keep)
    np.testing.assert_allclose(weight, np.where(want_keep, np.minimum(seq_ratio, 2.0)[:, None], 0.0), rtol=1e-6)
    for key in ("seq_tis_clipped_seq_frac", "seq_tis_weight_mean", "token_mis_masked_token_frac",
                "token_mis_masked_seq_frac", "token_mis_weight_mean"):
        assert key in metrics
    np.testing.assert_allclose(metrics["token_mis_masked_token_frac"], 2 / 7, rtol=1e-6)
    np.testing.assert_allclose(metrics["correction_weight_mean"], (0.6 * 2 + 2.0 * 3) / 5, rtol=1e-6)


@pytest.mark.parametrize("rejection", ["geo-rs", "seq-mis", "seq-kl-rs"])
def test_token_tis_with_sequence_rejections(rejection):
    data = _pair(LOG_R, MASK)
    reject = {
        "geo-rs": lambda *a: C.geo_rs(*a, lower=0.95, upper=1.1),     # geometric means 1, e^.25, e^.225
        "seq-mis": lambda *a: C.sequence_mis(*a, cap=2.0),            # ratios 1, e^.5, e^.9 = 2.46
        "seq-kl-rs": lambda *a: C.sequence_kl_rs(*a, estimator="k2", aggregate="max", threshold=0.1),
    }[rejection]
    weight, keep, metrics = C.combine_corrections(C.token_tis(*data, cap=1.2), reject(*data))
    kept_seq = np.array([True, False, True, False]) if rejection == "seq-kl-rs" else \
        np.array([True, False, False, False]) if rejection == "geo-rs" else np.array([True, True, False, False])
    want_keep = MASK & kept_seq[:, None]
    np.testing.assert_array_equal(keep, want_keep)
    np.testing.assert_allclose(weight, np.where(want_keep, np.minimum(np.exp(LOG_R), 1.2), 0.0), rtol=1e-6)
    assert "token_tis_weight_mean" in metrics and len(metrics) == 3 + 3 + 1


def test_combine_names_its_arguments():
    data = _pair(LOG_R, MASK)
    with pytest.raises(ValueError, match="is_correction and rejection"):
        C.combine_corrections(C.token_tis(*data), C.token_tis(*data))
    with pytest.raises(ValueError, match="rejection_keep"):
        C.combine_corrections(C.token_tis(*data), C.geo_rs(*(x[:2] for x in data)))


def test_roles():
    assert C.IS_WEIGHTS == (C.token_tis, C.sequence_tis)
    assert set(C.REJECTIONS) == {C.token_mis, C.sequence_mis, C.geo_rs, C.sequence_kl_rs}


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda d: C.sequence_kl_rs(*d, estimator="k1"), ["estimator", "'k1'", "k3"]),
        (lambda d: C.sequence_kl_rs(*d, aggregate="min"), ["aggregate", "'min'", "max"]),
        (lambda d: C.sequence_kl_rs(*d, threshold=0.0), ["threshold"]),
        (lambda d: C.sequence_mis(*d, lower=0.0), ["lower"]),
        (lambda d: C.sequence_mis(*d, cap=2.0, lower=3.0), ["lower", "cap"]),
        (lambda d: C.batch_normalize_is_weights(d[0], d[2], level="seq"), ["level", "sequence"]),
        (lambda d: C.batch_normalize_is_weights(d[2], d[2]), ["weight", "bool"]),
        (lambda d: C.batch_normalize_is_weights(d[0][0], d[2][0]), ["weight", "rank"]),
        (lambda d: C.batch_normalize_is_weights(d[0], d[2][:2]), ["mask", "(2, 4)"]),
    ],
)
def test_bad_input_names_the_argument(call, names):
    with pytest.raises(ValueError) as err:
        call(_pair(LOG_R, MASK))
    for name in names:
        assert name in str(err.value)
