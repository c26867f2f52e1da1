"""PNG figures of the mismatch, after the RL-collapse blog (matplotlib, Agg backend).

Each function takes an ``AlignmentBatch`` that carries learner logprobs, writes
one PNG and returns its path. ``write_all`` writes the four standard figures.
"""

from __future__ import annotations

import os

import numpy as np

from jaxrl.align.dump import AlignmentBatch
from jaxrl.align.metrics import bucket_metrics, sequence_log_ppl, token_view
from jaxrl.plotting import pyplot, save_figure

DPI = 110

# Scatter plots of millions of tokens are unreadable and slow; a fixed-seed
# subsample keeps the picture and the file small.
MAX_POINTS = 20_000


def _subsample(n: int, seed: int = 0) -> np.ndarray:
    if n <= MAX_POINTS:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, MAX_POINTS, replace=False))


def _turn_groups(turns: np.ndarray) -> list[tuple[str, np.ndarray, str]]:
    groups = [("first model turn", turns == 0, "tab:blue"), ("later turns", turns > 0, "tab:red")]
    return [g for g in groups if g[1].any()]


def prob_scatter(batch: AlignmentBatch, path: str) -> str:
    """Rollout probability (x) vs learner probability (y) per model token."""
    view = token_view(batch)
    keep = _subsample(view.rollout.size)
    fig, ax = pyplot().subplots(figsize=(5.5, 5))
    for label, sel, color in _turn_groups(view.turns[keep]):
        ax.scatter(np.exp(view.rollout[keep][sel]), np.exp(view.learner[keep][sel]),
                   s=3, alpha=0.35, color=color, label=label, rasterized=True)
    ax.plot([0, 1], [0, 1], color="black", lw=0.8, ls="--", label="equal")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="rollout probability", ylabel="learner probability",
           title=f"token probabilities ({view.rollout.size} model tokens)")
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(fig, path, dpi=DPI)


def log_ppl_scatter(batch: AlignmentBatch, path: str) -> str:
    """Per sequence and turn group: rollout log-perplexity (x) vs learner log-perplexity (y)."""
    fig, ax = pyplot().subplots(figsize=(5.5, 5))
    hi = 0.0
    for label, first in (("first model turn", True), ("later turns", False)):
        roll, learn = sequence_log_ppl(batch, first_turn=first)
        if roll.size == 0:
            continue
        hi = max(hi, float(np.max(roll)), float(np.max(learn)))
        ax.scatter(roll, learn, s=10, alpha=0.6, label=label,
                   color="tab:blue" if first else "tab:red")
    hi = hi * 1.05 or 1.0
    ax.plot([0, hi], [0, hi], color="black", lw=0.8, ls="--", label="equal")
    ax.set(xlabel="rollout log-ppl", ylabel="learner log-ppl", title="per-sequence log-perplexity")
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(fig, path, dpi=DPI)


def mismatch_vs_prob(batch: AlignmentBatch, path: str) -> str:
    """log(learner/rollout) per token against rollout probability (log x axis), with bucket means."""
    view = token_view(batch)
    keep = _subsample(view.rollout.size)
    prob = np.maximum(np.exp(view.rollout), 1e-12)
    log_ratio = view.learner - view.rollout
    fig, ax = pyplot().subplots(figsize=(6.5, 4.5))
    ax.scatter(prob[keep], log_ratio[keep], s=3, alpha=0.3, color="tab:gray", rasterized=True,
               label="token")
    buckets = [row for row in bucket_metrics(view) if row["num_tokens"]]
    centres = [np.sqrt(max(row["low"], 1e-12) * row["high"]) for row in buckets]
    means = [row["abs_log_ratio_mean"] for row in buckets]
    ax.plot(centres, means, "o-", color="tab:red", label="bucket mean |log ratio|")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set(xlim=(1e-9, 1.5), xlabel="rollout probability",
           ylabel="log(learner prob / rollout prob)", title="mismatch vs rollout probability")
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=DPI)


def log_ratio_histogram(batch: AlignmentBatch, path: str) -> str:
    """Histogram of the per-token log-ratio log(learner/rollout) (log count axis)."""
    view = token_view(batch)
    log_ratio = view.learner - view.rollout
    fig, ax = pyplot().subplots(figsize=(6, 4))
    span = float(np.max(np.abs(log_ratio))) if log_ratio.size else 0.0
    bins = np.linspace(-span, span, 81) if span > 0 else np.linspace(-1e-6, 1e-6, 3)
    ax.hist(log_ratio, bins=bins, color="tab:blue", log=True)
    ax.set(xlabel="log(learner prob / rollout prob)", ylabel="tokens",
           title=f"per-token log-ratio (max |.| = {span:.3g})")
    return save_figure(fig, path, dpi=DPI)


FIGURES = {
    "prob_scatter.png": prob_scatter,
    "log_ppl_scatter.png": log_ppl_scatter,
    "mismatch_vs_prob.png": mismatch_vs_prob,
    "log_ratio_hist.png": log_ratio_histogram,
}


def write_all(batch: AlignmentBatch, out_dir: str) -> list[str]:
    """Writes the four figures into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    return [draw(batch, os.path.join(out_dir, name)) for name, draw in FIGURES.items()]
