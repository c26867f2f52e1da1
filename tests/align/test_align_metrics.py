"""Checker metrics on hand-made batches whose values are known in closed form."""

import math

import numpy as np
import pytest

from jaxrl.align import AlignmentBatch, build_report
from jaxrl.align.metrics import sequence_log_ppl

LOG = math.log


def make_batch(rows):
    """rows: list of (prompt_len, [(rollout_prob, learner_prob, turn) or None for env token]).

    Prompt tokens come first; None entries are environment tokens (mask 0).
    """
    width = max(p + len(toks) for p, toks in rows)
    b = len(rows)
    ids = np.ones((b, width), np.int32)
    mask = np.zeros((b, width), bool)
    roll = np.zeros((b, width), np.float32)
    learn = np.zeros((b, width), np.float32)
    turns = np.full((b, width), -1, np.int32)
    for i, (p, toks) in enumerate(rows):
        for j, tok in enumerate(toks):
            if tok is None:
                continue
            t = p + j
            mask[i, t] = True
            roll[i, t], learn[i, t], turns[i, t] = LOG(tok[0]), LOG(tok[1]), tok[2]
    lengths = [p + len(toks) for p, toks in rows]
    return AlignmentBatch(ids, mask, roll, turns, [p for p, _ in rows], lengths, learner_logprobs=learn)


def test_identical_sources_give_zero_mismatch():
    batch = make_batch([(2, [(0.5, 0.5, 0), (0.1, 0.1, 0)]), (1, [(0.9, 0.9, 0), None, (0.3, 0.3, 1)])])
    o = build_report(batch)["overall"]
    for key in ("k1", "k2", "k3", "abs_log_ratio_mean", "abs_log_ratio_max", "prob_diff_mean",
                "chi2_token", "chi2_seq", "frac_outside_ratio_band", "log_ppl_diff"):
        assert o[key] == 0.0, key
    assert o["prob_pearson"] == pytest.approx(1.0, abs=1e-12)
    assert o["num_tokens"] == 4 and o["num_seqs"] == 2


def test_constant_ratio_two_closed_forms():
    # learner prob = 2 x rollout prob on every token: log_r = log 2.
    probs = [0.05, 0.2, 0.4, 0.1, 0.25]
    batch = make_batch([(3, [(p, 2 * p, 0) for p in probs[:3]]), (2, [(p, 2 * p, 0) for p in probs[3:]])])
    o = build_report(batch, ratio_band=(0.4, 2.5))["overall"]
    l2 = LOG(2)
    assert o["k1"] == pytest.approx(-l2, rel=1e-6)
    assert o["k2"] == pytest.approx(0.5 * l2 * l2, rel=1e-6)
    assert o["k3"] == pytest.approx(2 - l2 - 1, rel=1e-5)
    assert o["abs_log_ratio_mean"] == pytest.approx(l2, rel=1e-6)
    assert o["chi2_token"] == pytest.approx(3.0, rel=1e-5)
    # sequence ratios 2^3 and 2^2: chi2_seq = (64 + 16)/2 - 1
    assert o["chi2_seq"] == pytest.approx(39.0, rel=1e-5)
    assert o["prob_diff_mean"] == pytest.approx(np.mean(probs), rel=1e-6)
    assert o["prob_pearson"] == pytest.approx(1.0, abs=1e-9)
    assert o["frac_outside_ratio_band"] == 0.0
    assert o["log_ppl_diff"] == pytest.approx(-l2, rel=1e-6)
    narrow = build_report(batch, ratio_band=(0.5, 1.5))["overall"]
    assert narrow["frac_outside_ratio_band"] == 1.0


def test_mixed_tokens_hand_computed():
    # rollout/learner probs: (0.5, 0.25), (0.8, 0.8), (0.2, 0.1)  -> log_r = -l2, 0, -l2
    batch = make_batch([(1, [(0.5, 0.25, 0), (0.8, 0.8, 0), (0.2, 0.1, 0)])])
    o = build_report(batch, ratio_band=(0.45, 2.0))["overall"]
    l2 = LOG(2)
    assert o["k1"] == pytest.approx(2 * l2 / 3, rel=1e-6)
    assert o["k3"] == pytest.approx(2 * (0.5 + l2 - 1) / 3, rel=1e-5)
    assert o["abs_log_ratio_max"] == pytest.approx(l2, rel=1e-6)
    assert o["prob_diff_mean"] == pytest.approx((0.25 + 0 + 0.1) / 3, rel=1e-6)
    assert o["chi2_token"] == pytest.approx((0.25 + 1 + 0.25) / 3 - 1, rel=1e-5)
    assert o["chi2_seq"] == pytest.approx(0.25 ** 2 - 1, rel=1e-5)
    # ppl = exp(-mean log p)
    assert o["ppl_rollout"] == pytest.approx((0.5 * 0.8 * 0.2) ** (-1 / 3), rel=1e-6)
    assert o["ppl_learner"] == pytest.approx((0.25 * 0.8 * 0.1) ** (-1 / 3), rel=1e-6)
    x, y = np.array([0.5, 0.8, 0.2]), np.array([0.25, 0.8, 0.1])
    xc, yc = x - x.mean(), y - y.mean()
    assert o["prob_pearson"] == pytest.approx((xc @ yc) / math.sqrt((xc @ xc) * (yc @ yc)), rel=1e-6)
    assert o["frac_outside_ratio_band"] == 0.0  # ratio 0.5 (up to float32 rounding) is inside
    strict = build_report(batch, ratio_band=(0.6, 2.0))["overall"]
    assert strict["frac_outside_ratio_band"] == pytest.approx(2 / 3)


def test_buckets_are_log_spaced_down_to_1e8_and_hold_the_right_tokens():
    toks = [(3e-9, 3e-9, 0), (2e-5, 4e-5, 0), (5e-5, 5e-5, 0), (0.5, 0.5, 0), (1.0, 1.0, 0)]
    report = build_report(make_batch([(1, toks)]))
    edges = [(r["low"], r["high"]) for r in report["buckets"]]
    assert edges[0] == (0.0, 1e-8) and edges[1][0] == pytest.approx(1e-8) and edges[-1][1] == 1.0
    counts = {r["low"]: r["num_tokens"] for r in report["buckets"]}
    assert counts[0.0] == 1
    by_low = {round(math.log10(r["low"])) if r["low"] else None: r for r in report["buckets"]}
    assert by_low[-5]["num_tokens"] == 2
    assert by_low[-5]["abs_log_ratio_max"] == pytest.approx(LOG(2), rel=1e-5)
    assert by_low[-1]["num_tokens"] == 2  # 0.5 and exactly 1.0 (last bucket is closed)
    assert sum(r["num_tokens"] for r in report["buckets"]) == 5


def test_turn_split_first_vs_later():
    rows = [(2, [(0.5, 0.5, 0), None, None, (0.5, 0.25, 1), (0.4, 0.2, 1)]), (1, [(0.9, 0.9, 0)])]
    report = build_report(make_batch(rows))
    first, later = report["turns"]["first"], report["turns"]["later"]
    assert first["num_tokens"] == 2 and first["k3"] == 0.0
    assert later["num_tokens"] == 2 and later["num_seqs"] == 1
    assert later["k3"] == pytest.approx(0.5 + LOG(2) - 1, rel=1e-5)
    roll, learn = sequence_log_ppl(make_batch(rows), first_turn=False)
    assert roll == pytest.approx([-(LOG(0.5) + LOG(0.4)) / 2], rel=1e-6)
    assert learn == pytest.approx([-(LOG(0.25) + LOG(0.2)) / 2], rel=1e-6)


def test_agrees_with_the_trainer_float32_metrics_where_float32_resolves_them():
    # Moderate mismatch (|log r| ~ 0.1-1) so float32 k3 is accurate; same names, same values.
    import jax.numpy as jnp

    from jaxrl.losses.mismatch import mismatch_metrics

    rng = np.random.default_rng(0)
    rows = [(2, [(float(p), float(min(1.0, p * np.exp(rng.normal(0, 0.5)))), 0) for p in rng.uniform(0.01, 1, 7)])
            for _ in range(4)]
    batch = make_batch(rows)
    ours = build_report(batch)["overall"]
    theirs = mismatch_metrics(jnp.asarray(batch.learner_logprobs), jnp.asarray(batch.rollout_logprobs),
                              jnp.asarray(batch.model_mask))
    for key in ("k1", "k2", "k3", "abs_log_ratio_mean", "abs_log_ratio_max", "prob_diff_mean", "prob_pearson",
                "chi2_token", "ppl_learner", "ppl_rollout", "log_ppl_diff", "log_ppl_abs_diff_max", "chi2_seq",
                "num_tokens", "num_seqs"):
        assert ours[key] == pytest.approx(float(theirs[f"mismatch_{key}"]), rel=2e-5, abs=1e-6), key


def test_float64_resolves_k3_of_tiny_mismatch():
    # log r = 1e-4 on every token: k3 = exp(x) - 1 - x = 5.0002e-9 (closed form, Taylor).
    x = 1e-4
    batch = make_batch([(1, [(0.5, 0.5 * math.exp(x), 0)] * 4)])
    expected = x * x / 2 + x**3 / 6
    log_r = float(np.float32(batch.learner_logprobs[0, 1]) - np.float32(batch.rollout_logprobs[0, 1]))
    # the stored float32 logprobs quantise x; compare with the closed form at the stored value
    assert build_report(batch)["overall"]["k3"] == pytest.approx(log_r**2 / 2 + log_r**3 / 6, rel=1e-6)
    assert log_r == pytest.approx(x, rel=1e-2) and expected > 0
