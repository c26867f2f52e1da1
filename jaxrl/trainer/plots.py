"""End-of-run PNG plots from the metrics log: reward, entropy, the update's health, the SFT loss,
mismatch, the entropy-performance law."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from jaxrl.plotting import pyplot, save_figure
from jaxrl.reward.base import BUILTIN_REWARD_RANGE
from jaxrl.trainer.metrics import ENTROPY_KEYS


def _series(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    if not points:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*points, strict=True)
    return np.asarray(steps, float), np.asarray(values, float)


def _figure(title: str, ylabel: str):
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def entropy_key(rows: Sequence[dict]) -> str:
    return next((k for k in ENTROPY_KEYS if any(r.get(k) is not None for r in rows)), ENTROPY_KEYS[0])


# Divergences of the same kind (>= 0, dimensionless) that read together on one log axis;
# counts and perplexities logged under mismatch/ would swamp them.
MISMATCH_PLOT_KEYS = ("mismatch/k3", "mismatch/abs_log_ratio_mean", "mismatch/abs_log_ratio_max",
                      "mismatch/chi2_token", "mismatch/chi2_seq", "mismatch/prob_diff_mean")
# Below this a float32 divergence is rounding; plotted at the floor rather than dropped by the log axis.
LOG_AXIS_FLOOR = 1e-16
# The RL update's health at a glance, one panel each: (title, metric).
HEALTH_PANELS = (("loss", "update/loss"), ("gradient norm", "update/grad_norm"),
                 ("clip fraction", "update/clip_frac"), ("KL to the reference (k3)", "update/kl_k3"),
                 ("response length (tokens)", "rollout/response_length_mean"))
# Fewer points than this fit the entropy law to noise: no fit, no plot.
MIN_LAW_POINTS = 8
# A predicted ceiling outside the built-in rewards' range by more than this (1% of it: float32
# rounding and a perfect fit's noise aside) is an extrapolation.
RANGE_TOLERANCE = 0.01


def _plot_keys(rows, keys, title, ylabel, path, *, log_y: bool = False) -> str | None:
    series = [(key, *_series(rows, key)) for key in keys]
    series = [s for s in series if len(s[1])]
    if not series:
        return None
    fig, ax = _figure(title, ylabel)
    for key, steps, values in series:
        if log_y:
            values = np.maximum(np.abs(values), LOG_AXIS_FLOOR)
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
    if log_y:
        ax.set_yscale("log")
    if len(series) > 2:  # beside the axes: over them, several legend entries hide the curves
        fig.set_size_inches(9.0, 4.0)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    else:
        ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=100)


def _plot_health(rows: Sequence[dict], path: str) -> str | None:
    """One small panel per ``HEALTH_PANELS`` entry the run logged; None when it logged none of them."""
    panels = [(title, key, *_series(rows, key)) for title, key in HEALTH_PANELS]
    panels = [panel for panel in panels if len(panel[2])]
    if not panels:
        return None
    fig, axes = pyplot().subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), squeeze=False)
    axes = axes[0]
    for ax, (title, key, steps, values) in zip(axes, panels, strict=True):
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=100)


def law_equation(a: float, b: float) -> str:
    """``R = -a exp(H) + b`` with the fitted numbers, signs folded (``a < 0`` reads ``+ |a|``, not ``--``)."""
    a_sign, b_sign = "-" if a >= 0 else "+", "+" if b >= 0 else "-"
    return f"R = {a_sign}{abs(a):.3g} exp(H) {b_sign} {abs(b):.3g}"


def fit_run_entropy_law(rows: Sequence[dict], early_fraction: float = 0.5) -> dict | None:
    """Fits ``R = -a exp(H) + b`` (docs/losses.md#entropy-performance-law) on the first ``early_fraction``
    of logged steps.

    Returns ``{a, b, ceiling, ceiling_beyond_range, rmse, fit_steps, entropy, reward}`` (the last two:
    every step's points; ``ceiling_beyond_range``: the predicted ceiling lies outside the built-in
    rewards' ``BUILTIN_REWARD_RANGE``, an extrapolation of too few or too flat points), or None when fewer
    than ``MIN_LAW_POINTS`` steps would be fitted or the entropy never moved over them.
    """
    key = entropy_key(rows)
    points = [(r[key], r["reward/mean"]) for r in rows if r.get(key) is not None and r.get("reward/mean") is not None]
    entropy = np.asarray([p[0] for p in points], np.float32)
    reward = np.asarray([p[1] for p in points], np.float32)
    early = int(len(points) * early_fraction)
    if early < MIN_LAW_POINTS or np.ptp(entropy[:early]) == 0:
        return None
    import jax.numpy as jnp

    from jaxrl.losses.entropy import fit_entropy_law

    fit = fit_entropy_law(jnp.asarray(entropy[:early]), jnp.asarray(reward[:early]))
    ceiling = float(fit.ceiling)
    low, high = BUILTIN_REWARD_RANGE[0] - RANGE_TOLERANCE, BUILTIN_REWARD_RANGE[1] + RANGE_TOLERANCE
    return {"a": float(fit.a), "b": float(fit.b), "ceiling": ceiling, "rmse": float(fit.rmse),
            "ceiling_beyond_range": not low <= ceiling <= high, "fit_steps": early, "entropy": entropy,
            "reward": reward}


def plot_run(rows: Sequence[dict], out_dir: str, *, early_fraction: float = 0.5) -> dict[str, str]:
    """Writes the PNGs of a run into ``out_dir``; returns name -> path of those written.

    - reward.png: training reward mean and held-out reward;
    - entropy.png: mean token entropy;
    - health.png (RL): the update's loss, gradient norm, clip fraction, KL to the reference and the
      response length, a panel each (those the run logged);
    - loss.png (SFT): the loss and the negative log-likelihood per token;
    - mismatch.png: the engine-vs-learner divergences of ``MISMATCH_PLOT_KEYS``, log scale;
    - entropy_law.png: reward vs entropy, the fit ``R = -a exp(H) + b`` on the first
      ``early_fraction`` of steps (docs/losses.md#entropy-performance-law) and its predicted ceiling
      ``b - a``, marked as beyond the rewards' range when it is.
    """
    sft = any("sft/stage" in row for row in rows)
    os.makedirs(out_dir, exist_ok=True)
    keys = sorted({k for row in rows for k in row})
    written = {
        "reward": _plot_keys(rows, [k for k in keys if k.startswith(("reward/mean", "heldout/reward"))],
                             "reward", "reward", os.path.join(out_dir, "reward.png")),
        "entropy": _plot_keys(rows, [entropy_key(rows)], "policy entropy (nats/token)", "entropy",
                              os.path.join(out_dir, "entropy.png")),
        "loss": _plot_keys(rows, ["update/loss", "update/nll"], "SFT loss", "nats/token",
                           os.path.join(out_dir, "loss.png")) if sft else None,
        "health": None if sft else _plot_health(rows, os.path.join(out_dir, "health.png")),
        "mismatch": _plot_keys(rows, [k for k in MISMATCH_PLOT_KEYS if k in keys],
                               "training-inference mismatch (engine vs learner)", "value (log scale)",
                               os.path.join(out_dir, "mismatch.png"), log_y=True),
    }
    fit = fit_run_entropy_law(rows, early_fraction)
    if fit is not None:
        a, b, ceiling, early = fit["a"], fit["b"], fit["ceiling"], fit["fit_steps"]
        entropy, reward = fit["entropy"], fit["reward"]
        fig, ax = _figure(f"entropy-performance law: {law_equation(a, b)}", "reward")
        ax.set_xlabel("entropy H")
        ax.scatter(entropy[:early], reward[:early], s=12, label=f"fit steps ({early})")
        ax.scatter(entropy[early:], reward[early:], s=12, marker="x", label="later steps")
        grid = np.linspace(0.0, float(entropy.max()) * 1.05, 100)
        ax.plot(grid, b - a * np.exp(grid), color="k", label=f"fit (RMSE {fit['rmse']:.3g})")
        beyond = f", beyond the rewards' range {list(BUILTIN_REWARD_RANGE)}" if fit["ceiling_beyond_range"] else ""
        ax.axhline(ceiling, color="r", linestyle="--", label=f"predicted ceiling b-a = {ceiling:.3g}{beyond}")
        ax.legend(fontsize=8)
        written["entropy_law"] = save_figure(fig, os.path.join(out_dir, "entropy_law.png"), dpi=100)
    return {name: path for name, path in written.items() if path}
