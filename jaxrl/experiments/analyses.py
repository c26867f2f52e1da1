"""What the mismatch and entropy experiments conclude from their runs (docs/experiments.md).

Each ``analyze_*(out, spec, records)`` reads the runs' metrics, writes the figures under
``out/figures/`` and returns ``(claims, figures)`` for ``report.write_report``: a claim is
``(text, verdict, numbers)`` from ``report.compare`` with the config's thresholds.
"""

from __future__ import annotations

import math
import os

import numpy as np

from jaxrl.experiments.report import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, compare, curves_figure, series
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.plots import fit_run_entropy_law

ENTROPY = "recompute/entropy"
MISMATCH_KEYS = [("heldout/reward", "held-out reward"), ("mismatch/k3", "mismatch k3 (vllm-kl)"),
                 ("update/grad_norm", "gradient norm"), (ENTROPY, "entropy")]


def _runs(records: list[dict], **levels) -> list[dict]:
    return [r for r in records if all(r["levels"].get(k) == v for k, v in levels.items())]


def _finals(runs: list[dict]) -> list[float]:
    return [r["heldout_end"] for r in runs]


def _figures_dir(out: str) -> str:
    path = os.path.join(out, "figures")
    os.makedirs(path, exist_ok=True)
    return path


def analyze_mismatch(out: str, spec: dict, records: list[dict]):
    """Per injection, reward/k3/grad-norm/entropy curves per correction, and two kinds of claim:
    the uncorrected run ends below the clean engine's, and each correction ends above uncorrected."""
    figures, claims, effect = [], [], spec["min_effect"]
    clean = _runs(records, injection="clean", correction="none")
    injections = [i for i in dict.fromkeys(r["levels"]["injection"] for r in records) if i != "clean"]
    for injection in injections:
        runs = _runs(records, injection=injection)
        corrections = list(dict.fromkeys(r["levels"]["correction"] for r in runs))
        groups = {c: [read_jsonl(r["metrics"]) for r in _runs(runs, correction=c)] for c in corrections}
        if clean:
            groups["clean engine"] = [read_jsonl(r["metrics"]) for r in clean]
        figures.append(curves_figure(os.path.join(_figures_dir(out), f"mismatch_{injection}.png"), groups,
                                     MISMATCH_KEYS, f"GRPO on the demo, engine mismatch: {injection}"))
        uncorrected = _finals(_runs(runs, correction="none"))
        if clean and uncorrected:
            claims.append((f"{injection}: the uncorrected run ends below the clean engine's (held-out reward)",
                           *compare(_finals(clean), uncorrected, effect)))
        for correction in corrections:
            if correction != "none" and uncorrected:
                claims.append((f"{injection}: {correction} ends above the uncorrected run (held-out reward)",
                               *compare(_finals(_runs(runs, correction=correction)), uncorrected, effect)))
    return claims, figures


def _tail_mean(rows: list[dict], key: str, n: int = 3) -> float:
    values = series(rows, key)[1]
    return float(values[-n:].mean()) if len(values) else math.nan


def _forecast(rows: list[dict], fraction: float) -> dict | None:
    """The law fitted on the first ``fraction`` of the run and its forecast of the final reward
    (at the final entropy), against the reward reached (mean of the last 3 steps' train reward)."""
    fit = fit_run_entropy_law(rows, early_fraction=fraction)
    if fit is None:
        return None
    predicted = fit["b"] - fit["a"] * math.exp(float(fit["entropy"][-1]))
    return {**fit, "predicted": predicted, "reached": float(np.mean(fit["reward"][-3:]))}


def _law_figure(path: str, fits: dict[str, list[dict]]) -> str:
    from jaxrl.plotting import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for (name, runs), color in zip(fits.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False):
        for i, fit in enumerate(runs):
            ax.scatter(fit["entropy"], fit["reward"], s=6, color=color, alpha=0.5, label=name if i == 0 else None)
            h = np.linspace(float(np.min(fit["entropy"])), float(np.max(fit["entropy"])), 50)
            ax.plot(h, fit["b"] - fit["a"] * np.exp(h), color=color, lw=1)
    ax.set_xlabel("entropy (nats)")
    ax.set_ylabel("train reward")
    ax.set_title("R = -a exp(H) + b, fitted on the first third of each run", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=90)


def analyze_entropy(out: str, spec: dict, records: list[dict]):
    """Entropy and reward curves per control, the fitted law per run, and the claims: no control
    ends with lower entropy than Clip-Cov/KL-Cov, each control ends above no control in held-out
    reward, and the law's forecast from the first third of a run is within ``max_forecast_rmse``."""
    controls = list(dict.fromkeys(r["levels"]["control"] for r in records))
    rows = {c: [read_jsonl(r["metrics"]) for r in _runs(records, control=c)] for c in controls}
    keys = [(ENTROPY, "entropy"), ("reward/mean", "train reward"), ("heldout/reward", "held-out reward")]
    figures = [curves_figure(os.path.join(_figures_dir(out), "entropy_curves.png"), rows, keys,
                             "GRPO on the demo: entropy controls")]
    fits = {c: [f for f in (_forecast(r, spec["forecast_fraction"]) for r in runs) if f] for c, runs in rows.items()}
    figures.append(_law_figure(os.path.join(_figures_dir(out), "entropy_law.png"), fits))
    claims = []
    for control in controls:
        if control == "none":
            continue
        if control in ("clip-cov", "kl-cov"):
            claims.append((f"no entropy control ends with lower entropy than {control} (last 3 steps, nats)",
                           *compare([_tail_mean(r, ENTROPY) for r in rows[control]],
                                    [_tail_mean(r, ENTROPY) for r in rows["none"]], spec["min_entropy"])))
        claims.append((f"{control} ends above no control (held-out reward)",
                       *compare(_finals(_runs(records, control=control)), _finals(_runs(records, control="none")),
                                spec["min_effect"])))
    errors = [f["predicted"] - f["reached"] for runs in fits.values() for f in runs]
    per_run = "; ".join(f"{c}: " + ", ".join(f"a={f['a']:.3g} b={f['b']:.3g} forecast {f['predicted']:.3f} "
                                             f"reached {f['reached']:.3f}" for f in runs) for c, runs in fits.items())
    if len(errors) < 2 or min(len(f["entropy"]) for runs in fits.values() for f in runs) < 9:
        verdict = INCONCLUSIVE  # a law fitted on fewer than 3 points per run forecasts nothing
    else:
        rmse = math.sqrt(float(np.mean(np.square(errors))))
        verdict = REPRODUCED if rmse < spec["max_forecast_rmse"] else NOT_REPRODUCED
    rmse_text = f"RMSE {math.sqrt(float(np.mean(np.square(errors)))):.3f}" if errors else "no fits"
    claims.append(("the law fitted on the first third of a run forecasts its final reward "
                   f"(RMSE < {spec['max_forecast_rmse']})", verdict,
                   f"{rmse_text} over {len(errors)} runs ({per_run})"))
    return claims, figures


__all__ = ["analyze_entropy", "analyze_mismatch"]
