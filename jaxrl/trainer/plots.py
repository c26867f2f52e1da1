"""End-of-run PNG plots from the metrics log: reward, entropy, mismatch, the entropy-performance law."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np


def _series(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    if not points:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*points, strict=True)
    return np.asarray(steps, float), np.asarray(values, float)


def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# The policy's token entropy: the recompute's (the whole batch, before the update) when the run
# has one, else the update's (SFT, or RL with objective.bypass).
ENTROPY_KEYS = ("recompute/entropy", "update/entropy")


def entropy_key(rows: Sequence[dict]) -> str:
    return next((k for k in ENTROPY_KEYS if any(r.get(k) is not None for r in rows)), ENTROPY_KEYS[0])


# Divergences of the same kind (>= 0, dimensionless) that read together on one log axis;
# counts and perplexities logged under mismatch/ would swamp them.
MISMATCH_PLOT_KEYS = ("mismatch/k3", "mismatch/abs_log_ratio_mean", "mismatch/abs_log_ratio_max",
                      "mismatch/chi2_token", "mismatch/chi2_seq", "mismatch/prob_diff_mean")
# Below this a float32 divergence is rounding; plotted at the floor rather than dropped by the log axis.
LOG_AXIS_FLOOR = 1e-16


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
    ax.legend(fontsize=8)
    return _save(fig, path)


def fit_run_entropy_law(rows: Sequence[dict], early_fraction: float = 0.5) -> dict | None:
    """Fits ``R = -a exp(H) + b`` (docs/losses.md#entropy-performance-law) on the first ``early_fraction``
    of logged steps.

    Returns ``{a, b, ceiling, rmse, fit_steps, entropy, reward}`` (the last two: every step's
    points), or None when fewer than 2 steps logged entropy and reward or entropy never moved.
    """
    key = entropy_key(rows)
    points = [(r[key], r["reward/mean"]) for r in rows if r.get(key) is not None and r.get("reward/mean") is not None]
    entropy = np.asarray([p[0] for p in points], np.float32)
    reward = np.asarray([p[1] for p in points], np.float32)
    early = max(2, int(len(points) * early_fraction))
    if len(points) < 2 or np.ptp(entropy[:early]) == 0:
        return None
    import jax.numpy as jnp

    from jaxrl.losses.entropy import fit_entropy_law

    fit = fit_entropy_law(jnp.asarray(entropy[:early]), jnp.asarray(reward[:early]))
    return {"a": float(fit.a), "b": float(fit.b), "ceiling": float(fit.ceiling), "rmse": float(fit.rmse),
            "fit_steps": early, "entropy": entropy, "reward": reward}


def plot_run(rows: Sequence[dict], out_dir: str, *, early_fraction: float = 0.5) -> dict[str, str]:
    """Writes the PNGs of a run into ``out_dir``; returns name -> path of those written.

    - reward.png: training reward mean and held-out reward;
    - entropy.png: mean token entropy;
    - mismatch.png: the engine-vs-learner divergences of ``MISMATCH_PLOT_KEYS``, log scale;
    - entropy_law.png: reward vs entropy, the fit ``R = -a exp(H) + b`` on the first
      ``early_fraction`` of steps (docs/losses.md#entropy-performance-law) and its predicted ceiling ``b - a``.
    """
    os.makedirs(out_dir, exist_ok=True)
    keys = sorted({k for row in rows for k in row})
    written = {
        "reward": _plot_keys(rows, [k for k in keys if k.startswith(("reward/mean", "heldout/reward"))],
                             "reward", "reward", os.path.join(out_dir, "reward.png")),
        "entropy": _plot_keys(rows, [entropy_key(rows)], "policy entropy (nats/token)", "entropy",
                              os.path.join(out_dir, "entropy.png")),
        "mismatch": _plot_keys(rows, [k for k in MISMATCH_PLOT_KEYS if k in keys],
                               "training-inference mismatch (engine vs learner)", "value (log scale)",
                               os.path.join(out_dir, "mismatch.png"), log_y=True),
    }
    fit = fit_run_entropy_law(rows, early_fraction)
    if fit is not None:
        a, b, ceiling, early = fit["a"], fit["b"], fit["ceiling"], fit["fit_steps"]
        entropy, reward = fit["entropy"], fit["reward"]
        fig, ax = _figure(f"entropy-performance law: R = -{a:.3g} exp(H) + {b:.3g}", "reward")
        ax.set_xlabel("entropy H")
        ax.scatter(entropy[:early], reward[:early], s=12, label=f"fit steps ({early})")
        ax.scatter(entropy[early:], reward[early:], s=12, marker="x", label="later steps")
        grid = np.linspace(0.0, float(entropy.max()) * 1.05, 100)
        ax.plot(grid, b - a * np.exp(grid), color="k", label=f"fit (RMSE {fit['rmse']:.3g})")
        ax.axhline(ceiling, color="r", linestyle="--", label=f"predicted ceiling b-a = {ceiling:.3g}")
        ax.legend(fontsize=8)
        written["entropy_law"] = _save(fig, os.path.join(out_dir, "entropy_law.png"))
    return {name: path for name, path in written.items() if path}
