"""Verdicts, figures and ``report.md`` of an experiment (docs/experiments.md#verdicts).

A verdict compares two groups of runs (or any two sets of per-seed numbers) with a threshold
fixed in the experiment's config before it runs: "reproduced" when the difference points the
papers' way by more than ``min_effect`` and by more than 2 standard errors; "not reproduced"
when even its upper bound (difference + 2 standard errors) is below ``min_effect``; otherwise,
and always with fewer than 2 values per group, "inconclusive at this scale".
"""

from __future__ import annotations

import math
import os

import numpy as np

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive at this scale"
LOG_FLOOR = 1e-10  # where a log-scale panel draws values of 0 (and spreads that reach below)


def mean_spread(values) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value) of the finite values."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    if x.size == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else 0.0


def compare(better, worse, min_effect: float) -> tuple[str, str]:
    """(verdict, the numbers) for the claim "``better`` exceeds ``worse``" (see the module doc)."""
    a, b = [np.asarray([v for v in g if v is not None and math.isfinite(v)], np.float64) for g in (better, worse)]
    if a.size == 0 or b.size == 0:
        return INCONCLUSIVE, "no values"
    diff = float(a.mean() - b.mean())
    numbers = f"{a.mean():.3f} vs {b.mean():.3f} (difference {diff:+.3f}"
    if a.size < 2 or b.size < 2:
        return INCONCLUSIVE, numbers + f"; {min(a.size, b.size)} seed: no spread)"
    se = math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    numbers += f", 2 SE {2 * se:.3f}, threshold {min_effect})"
    if diff > min_effect and diff > 2 * se:
        return REPRODUCED, numbers
    if diff + 2 * se < min_effect:
        return NOT_REPRODUCED, numbers
    return INCONCLUSIVE, numbers


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key`` over a run's metrics rows."""
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return np.asarray([p[0] for p in points]), np.asarray([p[1] for p in points], np.float64)


def curves_figure(path: str, groups: dict[str, list[list[dict]]], keys: list[tuple[str, str]], title: str) -> str:
    """One panel per (metric key, label): each group's mean curve over its runs, the spread shaded."""
    from jaxrl.plotting import pyplot, save_figure

    plt = pyplot()

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, (key, label) in zip(axes[0], keys, strict=True):
        # Mismatch metrics span orders of magnitude and are >= 0: a log axis, 0 drawn at LOG_FLOOR.
        floor = LOG_FLOOR if key.startswith("mismatch/") else -np.inf
        for name, runs in groups.items():
            curves = [series(rows, key) for rows in runs]
            curves = [c for c in curves if len(c[0])]
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            values = np.stack([c[1][:n] for c in curves])
            mean, std = values.mean(0), values.std(0)
            ax.plot(curves[0][0][:n], np.maximum(mean, floor), label=name)
            ax.fill_between(curves[0][0][:n], np.maximum(mean - std, floor), np.maximum(mean + std, floor), alpha=0.15)
        ax.set_xlabel("step")
        ax.set_title(label + (f" (0 drawn at {LOG_FLOOR:g})" if floor > 0 else ""), fontsize=9)
        if floor > 0:
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=90)


def write_report(out: str, title: str, intro: str, table: list[tuple], claims: list[tuple[str, str, str]],
                 figures: list[str], footer: str) -> str:
    """``out/report.md``: the intro, the final held-out reward table (cell, mean, spread, n, seconds),
    one verdict line per claim (``- **verdict**: claim: numbers``), the figures, the footer."""
    lines = [f"# {title}", "", intro, "", "| cell | final held-out reward (mean) | spread (std) | seeds | "
             "seconds per run |", "|---|---|---|---|---|"]
    lines += [f"| {cell} | {mean:.3f} | {std:.3f} | {n} | {secs:.0f} |" for cell, mean, std, n, secs in table]
    lines += ["", "## Verdicts", ""]
    lines += [f"- **{verdict}**: {claim}: {numbers}" for claim, verdict, numbers in claims]
    lines += ["", "## Figures", ""] + [f"![{os.path.basename(f)}]({os.path.relpath(f, out)})" for f in figures]
    lines += ["", footer, ""]
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def reward_table(records: list[dict]) -> list[tuple]:
    """Per cell, in grid order: (cell, mean and std of the final held-out reward, seeds, mean seconds)."""
    order = list(dict.fromkeys(r["cell"] for r in records))
    table = []
    for cell in order:
        runs = [r for r in records if r["cell"] == cell]
        mean, std = mean_spread([r["heldout_end"] for r in runs])
        table.append((cell, mean, std, len(runs), float(np.mean([r["seconds"] for r in runs]))))
    return table


__all__ = ["INCONCLUSIVE", "NOT_REPRODUCED", "REPRODUCED", "compare", "curves_figure", "mean_spread",
           "reward_table", "series", "write_report"]
