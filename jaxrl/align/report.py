"""Writing a checker run to disk: report.json, summary.txt, the PNG figures, the gate verdict."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from jaxrl.align import plots
from jaxrl.align.dump import AlignmentBatch
from jaxrl.align.gate import Gate, GateResult
from jaxrl.align.metrics import DEFAULT_RATIO_BAND, build_report, format_summary


def _json_safe(x: Any) -> Any:
    # JSON has no NaN/inf; write them as strings so the file stays standard JSON.
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_report(batch: AlignmentBatch, out_dir: str, *, gate: Gate | None = None,
                 ratio_band: tuple[float, float] = DEFAULT_RATIO_BAND,
                 figures: bool = True) -> tuple[dict[str, Any], GateResult | None, str]:
    """Computes the report and writes ``out_dir/{report.json, summary.txt, *.png}``.

    Returns (report, gate result or None, summary text).
    """
    os.makedirs(out_dir, exist_ok=True)
    report = build_report(batch, ratio_band=ratio_band)
    result = gate.check(report) if gate is not None else None
    summary = format_summary(report)
    if result is not None:
        report["gate"] = {"passed": result.passed, "checks": list(result.checks)}
        summary += "\n" + ("gate: PASSED" if result.passed else "gate: FAILED\n  " + "\n  ".join(result.failures))
    if figures:
        report["figures"] = [os.path.basename(p) for p in plots.write_all(batch, out_dir)]
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(_json_safe(report), f, indent=2)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    return report, result, summary
