"""The alignment gate: upper limits on report metrics, for CI (the trainer's batch filter is
``jaxrl.losses.mismatch.batch_filter``, not this).

``Gate(limits={"k3": 1e-3, "abs_log_ratio_max": 0.5})`` passes a report when
every named metric of ``report["overall"]`` is at most its limit. A NaN metric
fails (it means the comparison itself is broken). ``jaxrl align`` exits 1 when
the gate fails.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

# Metrics a limit may name: the "overall" entries of jaxrl.align.metrics.build_report
# where larger means worse.
GATEABLE = (
    "k1", "k2", "k3", "abs_log_ratio_mean", "abs_log_ratio_max", "prob_diff_mean",
    "prob_diff_max", "chi2_token", "chi2_seq", "frac_outside_ratio_band",
    "log_ppl_abs_diff_max",
)


@dataclasses.dataclass(frozen=True)
class GateResult:
    passed: bool
    failures: tuple[str, ...]
    checks: tuple[dict[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Gate:
    """Upper limits per metric name (a key of ``GATEABLE``)."""

    limits: Mapping[str, float]

    def __post_init__(self):
        limits = dict(self.limits)
        for name, value in limits.items():
            if name not in GATEABLE:
                raise ValueError(f"Gate.limits has unknown metric {name!r}; choose from {list(GATEABLE)}")
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"Gate.limits[{name!r}] must be a number >= 0, got {value!r}")
        object.__setattr__(self, "limits", {k: float(v) for k, v in limits.items()})

    def check(self, report: Mapping[str, Any]) -> GateResult:
        overall = report["overall"]
        checks, failures = [], []
        for name, limit in self.limits.items():
            value = float(overall[name])
            ok = value <= limit  # False for NaN as well
            checks.append({"metric": name, "value": value, "limit": limit, "passed": ok})
            if not ok:
                failures.append(f"{name} = {value:.6g} exceeds the limit {limit:.6g}")
        return GateResult(passed=not failures, failures=tuple(failures), checks=tuple(checks))
