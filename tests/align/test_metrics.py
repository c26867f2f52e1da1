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
    for key in ("k1", "k2", "k3", "mean_abs_log_ratio", "max_abs_log_ratio", "mean_abs_prob_diff",
                "chi2_token", "chi2_sequence", "frac_outside_ratio_band", "mean_log_ppl_diff"):
        assert o[key] == 0.0, key
    assert o["pearson_prob"] == pytest.approx(1.0, abs=1e-12)
    assert o["n_tokens"] == 4 and o["n_sequences"] == 2


def test_constant_ratio_two_closed_forms():
    # learner prob = 2 x rollout prob on every token: log_r = log 2.
    probs = [0.05, 0.2, 0.4, 0.1, 0.25]
    batch = make_batch([(3, [(p, 2 * p, 0) for p in probs[:3]]), (2, [(p, 2 * p, 0) for p in probs[3:]])])
    o = build_report(batch, ratio_band=(0.4, 2.5))["overall"]
    l2 = LOG(2)
    assert o["k1"] == pytest.approx(-l2, rel=1e-6)
    assert o["k2"] == pytest.approx(0.5 * l2 * l2, rel=1e-6)
    assert o["k3"] == pytest.approx(2 - l2 - 1, rel=1e-5)
    assert o["mean_abs_log_ratio"] == pytest.approx(l2, rel=1e-6)
    assert o["chi2_token"] == pytest.approx(3.0, rel=1e-5)
    # sequence ratios 2^3 and 2^2: chi2_seq = (64 + 16)/2 - 1
    assert o["chi2_sequence"] == pytest.approx(39.0, rel=1e-5)
    assert o["mean_abs_prob_diff"] == pytest.approx(np.mean(probs), rel=1e-6)
    assert o["pearson_prob"] == pytest.approx(1.0, abs=1e-9)
    assert o["frac_outside_ratio_band"] == 0.0
    assert o["mean_log_ppl_diff"] == pytest.approx(-l2, rel=1e-6)
    narrow = build_report(batch, ratio_band=(0.5, 1.5))["overall"]
    assert narrow["frac_outside_ratio_band"] == 1.0


def test_mixed_tokens_hand_computed():
    # rollout/learner probs: (0.5, 0.25), (0.8, 0.8), (0.2, 0.1)  -> log_r = -l2, 0, -l2
    batch = make_batch([(1, [(0.5, 0.25, 0), (0.8, 0.8, 0), (0.2, 0.1, 0)])])
    o = build_report(batch, ratio_band=(0.45, 2.0))["overall"]
    l2 = LOG(2)
    assert o["k1"] == pytest.approx(2 * l2 / 3, rel=1e-6)
    assert o["k3"] == pytest.approx(2 * (0.5 + l2 - 1) / 3, rel=1e-5)
    assert o["max_abs_log_ratio"] == pytest.approx(l2, rel=1e-6)
    assert o["mean_abs_prob_diff"] == pytest.approx((0.25 + 0 + 0.1) / 3, rel=1e-6)
    assert o["chi2_token"] == pytest.approx((0.25 + 1 + 0.25) / 3 - 1, rel=1e-5)
    assert o["chi2_sequence"] == pytest.approx(0.25 ** 2 - 1, rel=1e-5)
    # ppl = exp(-mean log p)
    assert o["rollout_ppl"] == pytest.approx((0.5 * 0.8 * 0.2) ** (-1 / 3), rel=1e-6)
    assert o["learner_ppl"] == pytest.approx((0.25 * 0.8 * 0.1) ** (-1 / 3), rel=1e-6)
    x, y = np.array([0.5, 0.8, 0.2]), np.array([0.25, 0.8, 0.1])
    xc, yc = x - x.mean(), y - y.mean()
    assert o["pearson_prob"] == pytest.approx((xc @ yc) / math.sqrt((xc @ xc) * (yc @ yc)), rel=1e-6)
    assert o["frac_outside_ratio_band"] == 0.0  # ratio 0.5 (up to float32 rounding) is inside
    strict = build_report(batch, ratio_band=(0.6, 2.0))["overall"]
    assert strict["frac_outside_ratio_band"] == pytest.approx(2 / 3)


def test_buckets_are_log_spaced_down_to_1e8_and_hold_the_right_tokens():
    toks = [(3e-9, 3e-9, 0), (2e-5, 4e-5, 0), (5e-5, 5e-5, 0), (0.5, 0.5, 0), (1.0, 1.0, 0)]
    report = build_report(make_batch([(1, toks)]))
    edges = [(r["low"], r["high"]) for r in report["buckets"]]
    assert edges[0] == (0.0, 1e-8) and edges[1][0] == pytest.approx(1e-8) and edges[-1][1] == 1.0
    counts = {r["low"]: r["n_tokens"] for r in report["buckets"]}
    assert counts[0.0] == 1
    by_low = {round(math.log10(r["low"])) if r["low"] else None: r for r in report["buckets"]}
    assert by_low[-5]["n_tokens"] == 2
    assert by_low[-5]["max_abs_log_ratio"] == pytest.approx(LOG(2), rel=1e-5)
    assert by_low[-1]["n_tokens"] == 2  # 0.5 and exactly 1.0 (last bucket is closed)
    assert sum(r["n_tokens"] for r in report["buckets"]) == 5


def test_turn_split_first_vs_later():
    rows = [(2, [(0.5, 0.5, 0), None, None, (0.5, 0.25, 1), (0.4, 0.2, 1)]), (1, [(0.9, 0.9, 0)])]
    report = build_report(make_batch(rows))
    first, later = report["turns"]["first"], report["turns"]["later"]
    assert first["n_tokens"] == 2 and first["k3"] == 0.0
    assert later["n_tokens"] == 2 and later["n_sequences"] == 1
    assert later["k3"] == pytest.approx(0.5 + LOG(2) - 1, rel=1e-5)
    roll, learn = sequence_log_ppl(make_batch(rows), first_turn=False)
    assert roll == pytest.approx([-(LOG(0.5) + LOG(0.4)) / 2], rel=1e-6)
    assert learn == pytest.approx([-(LOG(0.25) + LOG(0.2)) / 2], rel=1e-6)
