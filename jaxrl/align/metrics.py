"""Mismatch metrics of docs/alignment.md#metrics over an ``AlignmentBatch``: overall, per
rollout-probability bucket, per turn; the JSON report and the text summary.

Conventions: per model token ``log_r = learner_logp - rollout_logp`` (learner
minus rollout). Only tokens with ``model_mask`` count. The statistics and their
names are those of ``jaxrl.losses.mismatch`` (the trainer logs the same keys
with a ``mismatch_`` prefix), plus the signed mean log-ratio, the max |prob
diff|, the mean log-perplexities and the fraction of tokens outside a ratio band.

Why a float64 NumPy version beside the jittable float32 one in
``jaxrl.losses.mismatch``: the checker exists to measure small mismatches, and
``k3 = exp(x) - 1 - x`` loses precision in float32 even in its ``expm1(x) - x``
form: the subtraction leaves a relative error of about ``2 eps / |x|``, 25% at
``|x| = 1e-6`` (the scale of the float32 engine-vs-learner residual). In
float64 that error is about 2e-16 / |x|, negligible down to the float32
logprob resolution. tests/align/test_align_metrics.py checks both versions agree
where float32 resolves the values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxrl.align.dump import AlignmentBatch
from jaxrl.losses.mismatch import DEFAULT_PROB_EDGES

# Decades from 1e-8 to 1, plus everything below 1e-8 (docs/losses.md#mismatch-metrics: log-spaced bins down to 1e-8).
DEFAULT_BUCKET_EDGES: tuple[float, ...] = DEFAULT_PROB_EDGES
DEFAULT_RATIO_BAND: tuple[float, float] = (0.5, 2.0)


@dataclasses.dataclass(frozen=True)
class TokenView:
    """Flattened model tokens: rollout/learner logprobs [N] float64, turn [N], sequence index [N]."""

    rollout: np.ndarray
    learner: np.ndarray
    turns: np.ndarray
    sequence: np.ndarray


def _require_learner(batch: AlignmentBatch) -> np.ndarray:
    if batch.learner_logprobs is None:
        raise ValueError(
            "the batch has no learner_logprobs; score it with the learner first "
            "(jaxrl.align.check.score_with_learner) or dump batches after the recompute"
        )
    return batch.learner_logprobs


def token_view(batch: AlignmentBatch) -> TokenView:
    learner = _require_learner(batch)
    mask = batch.model_mask
    rows = np.broadcast_to(np.arange(batch.num_sequences)[:, None], mask.shape)
    return TokenView(
        rollout=batch.rollout_logprobs[mask].astype(np.float64),
        learner=learner[mask].astype(np.float64),
        turns=batch.turn_ids[mask],
        sequence=rows[mask],
    )


def _select(view: TokenView, keep: np.ndarray) -> TokenView:
    return TokenView(view.rollout[keep], view.learner[keep], view.turns[keep], view.sequence[keep])


def _per_sequence_means(view: TokenView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sequence present in ``view``: mean rollout logp, mean learner logp, sum of log_r."""
    seqs, inverse, counts = np.unique(view.sequence, return_inverse=True, return_counts=True)
    del seqs
    roll = np.bincount(inverse, view.rollout) / counts
    learn = np.bincount(inverse, view.learner) / counts
    log_r_sum = np.bincount(inverse, view.learner - view.rollout)
    return roll, learn, log_r_sum


def sequence_log_ppl(batch: AlignmentBatch, first_turn: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence log-perplexity ``-mean_t logp`` (rollout, learner) over model tokens.

    ``first_turn`` True/False restricts each sequence to its first / later model turns.
    """
    view = token_view(batch)
    if first_turn is not None:
        view = _select(view, view.turns == 0 if first_turn else view.turns > 0)
    if view.rollout.size == 0:
        return np.zeros(0), np.zeros(0)
    roll, learn, _ = _per_sequence_means(view)
    return -roll, -learn


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if x.size < 2 or np.std(x) == 0 or np.std(y) == 0:
        # Undefined (constant input): report NaN rather than a made-up value.
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def group_metrics(view: TokenView, ratio_band: tuple[float, float] = DEFAULT_RATIO_BAND,
                  sequence_level: bool = True) -> dict[str, float]:
    """Every docs/alignment.md#metrics statistic over the tokens of ``view``.

    k1 = mean(-log_r), k2 = mean(log_r^2 / 2), k3 = mean(exp(log_r) - log_r - 1)
    estimate KL(rollout || learner) from rollout samples (k3 is the blog's vllm-kl);
    chi2_token = mean(exp(log_r)^2) - 1; chi2_seq = mean_seq(exp(sum_t log_r)^2) - 1.
    """
    n = view.rollout.size
    out: dict[str, float] = {"num_tokens": int(n)}
    if n == 0:
        return out
    log_r = view.learner - view.rollout
    ratio = np.exp(log_r)
    p_roll, p_learn = np.exp(view.rollout), np.exp(view.learner)
    lo, hi = ratio_band
    out.update(
        k1=float(np.mean(-log_r)),
        k2=float(np.mean(0.5 * log_r**2)),
        k3=float(np.mean(ratio - log_r - 1.0)),
        log_ratio_mean=float(np.mean(log_r)),
        abs_log_ratio_mean=float(np.mean(np.abs(log_r))),
        abs_log_ratio_max=float(np.max(np.abs(log_r))),
        prob_diff_mean=float(np.mean(np.abs(p_learn - p_roll))),
        prob_diff_max=float(np.max(np.abs(p_learn - p_roll))),
        prob_pearson=_pearson(p_roll, p_learn),
        chi2_token=float(np.mean(ratio**2) - 1.0),
        frac_outside_ratio_band=float(np.mean((ratio < lo) | (ratio > hi))),
    )
    if sequence_level:
        roll, learn, log_r_sum = _per_sequence_means(view)
        log_ppl_diff = (-learn) - (-roll)
        with np.errstate(over="ignore"):
            out.update(
                num_seqs=int(roll.size),
                ppl_rollout=float(np.mean(np.exp(-roll))),
                ppl_learner=float(np.mean(np.exp(-learn))),
                log_ppl_rollout=float(np.mean(-roll)),
                log_ppl_learner=float(np.mean(-learn)),
                log_ppl_diff=float(np.mean(log_ppl_diff)),
                log_ppl_abs_diff_max=float(np.max(np.abs(log_ppl_diff))),
                chi2_seq=float(np.mean(np.exp(2.0 * log_r_sum)) - 1.0),
            )
    return out


def bucket_metrics(view: TokenView, edges=DEFAULT_BUCKET_EDGES,
                   ratio_band: tuple[float, float] = DEFAULT_RATIO_BAND) -> list[dict[str, Any]]:
    """Token statistics per rollout-probability bucket ``[lo, hi)`` (the last one includes 1)."""
    edges = tuple(float(e) for e in edges)
    if list(edges) != sorted(edges) or edges[0] < 0 or edges[-1] > 1:
        raise ValueError(f"bucket edges must be increasing probabilities in [0, 1], got {edges}")
    prob = np.exp(view.rollout)
    rows = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        last = i == len(edges) - 2
        keep = (prob >= lo) & ((prob <= hi) if last else (prob < hi))
        rows.append({"low": lo, "high": hi,
                     **group_metrics(_select(view, keep), ratio_band, sequence_level=False)})
    return rows


def build_report(batch: AlignmentBatch, *, edges=DEFAULT_BUCKET_EDGES,
                 ratio_band: tuple[float, float] = DEFAULT_RATIO_BAND) -> dict[str, Any]:
    """The checker's report: overall, per bucket, per turn (first vs later model turns)."""
    lo, hi = (float(x) for x in ratio_band)
    if not 0 < lo <= 1 <= hi:
        raise ValueError(f"ratio_band must satisfy 0 < low <= 1 <= high, got {ratio_band}")
    view = token_view(batch)
    if view.rollout.size == 0:
        raise ValueError("the batch has no model tokens (model_mask is all 0); nothing to compare")
    return {
        "meta": dict(batch.meta),
        "ratio_band": [lo, hi],
        "overall": group_metrics(view, (lo, hi)),
        "buckets": bucket_metrics(view, edges, (lo, hi)),
        "turns": {
            "first": group_metrics(_select(view, view.turns == 0), (lo, hi)),
            "later": group_metrics(_select(view, view.turns > 0), (lo, hi)),
        },
    }


def _fmt(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return "nan" if math.isnan(x) else f"{x:.3g}"


def format_summary(report: dict[str, Any]) -> str:
    """A short human-readable summary of ``build_report``'s output."""
    o = report["overall"]
    lo, hi = report["ratio_band"]
    meta = report["meta"]
    facts = [f"{k.replace('_', ' ')} {meta[k]}" for k in ("engine", "weight_version", "logprob_kind") if k in meta]
    lines = [
        f"alignment: {o['num_tokens']} model tokens in {o['num_seqs']} sequences"
        + (f" ({', '.join(facts)})" if facts else ""),
        f"  k3 (vllm-kl) {_fmt(o['k3'])}   k1 {_fmt(o['k1'])}   k2 {_fmt(o['k2'])}",
        f"  |log ratio| mean {_fmt(o['abs_log_ratio_mean'])} max {_fmt(o['abs_log_ratio_max'])}   "
        f"|prob diff| mean {_fmt(o['prob_diff_mean'])}   pearson {_fmt(o['prob_pearson'])}",
        f"  ppl rollout {_fmt(o['ppl_rollout'])} learner {_fmt(o['ppl_learner'])}   "
        f"chi2 token {_fmt(o['chi2_token'])} sequence {_fmt(o['chi2_seq'])}",
        f"  tokens with ratio outside [{lo:g}, {hi:g}]: {_fmt(o['frac_outside_ratio_band'])}",
        "  by rollout probability:",
    ]
    if meta.get("logprob_kind") == "processed":
        lines.insert(1, "  note: the engine returned PROCESSED logprobs (temperature/top-k/top-p distribution) but the "
                        "learner recomputes RAW ones: this measures that bias, not an implementation mismatch")
    for row in report["buckets"]:
        if row["num_tokens"]:
            lines.append(f"    [{row['low']:.0e}, {row['high']:.0e}): {row['num_tokens']:7d} tokens  "
                         f"k3 {_fmt(row['k3'])}  max |log ratio| {_fmt(row['abs_log_ratio_max'])}")
    for name, g in report["turns"].items():
        if g["num_tokens"]:
            label = "first model turn" if name == "first" else "later model turns"
            lines.append(f"  {label}: {g['num_tokens']} tokens  k3 {_fmt(g['k3'])}  "
                         f"max |log ratio| {_fmt(g['abs_log_ratio_max'])}")
    return "\n".join(lines)
