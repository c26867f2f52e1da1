"""``jaxrl experiment NAME [--quick] [--steps N] [--out DIR]``: the three experiments, one declaration each.

An experiment is its config (``configs/experiments/NAME.yaml`` over ``common.yaml``), the axes
of its grid (keys of that config) and the analysis that turns its runs into claims and figures
(docs/experiments.md).

A grid stopped part-way continues when the same command runs again: each finished run's record
is kept (``runner.run_cell``), the run that was cut short starts afresh. SIGTERM or Ctrl-C stop
it after the current step with one line saying so (exit 128 + the signal); one invocation at a
time holds ``--out`` (``out/run.lock``): a second is refused, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from typing import Callable

from jaxrl.errors import InputError
from jaxrl.experiments import analyses, kl, report, runner
from jaxrl.trainer.lifecycle import RunLock, TrainingInterrupted


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    title: str
    axes: tuple[str, ...]
    analyze: Callable  # (out, spec, records) -> (claims, figures)


EXPERIMENTS = {e.name: e for e in (
    Experiment("mismatch", "Mismatch collapse: engine-side mismatch x correction", ("injection", "correction"),
               analyses.analyze_mismatch),
    Experiment("entropy", "Entropy collapse: entropy controls and the entropy-reward law", ("control",),
               analyses.analyze_entropy),
    Experiment("kl", "KL estimators: k1, k2, k3 as losses and k1 in the reward", ("kl",), kl.analyze_kl),
)}


def run(name: str, out: str, *, quick: bool = False, steps: int | None = None, log=print) -> str:
    """Runs experiment ``name``'s grid into ``out`` and writes its report; returns report.md's path."""
    experiment = EXPERIMENTS[name]
    spec = runner.load_spec(name)
    spec["quick_run"] = quick
    start = time.perf_counter()
    _, records = runner.run_grid(spec, experiment.axes, out, quick=quick, steps=steps, log=log)
    claims, figures = experiment.analyze(out, spec, records)
    seeds = len(spec["seeds"][:1] if quick else spec["seeds"])
    elapsed = time.perf_counter() - start
    run_seconds, kept = sum(r["seconds"] for r in records), sum(bool(r.get("kept")) for r in records)
    scale = (f"{'QUICK RUN: ' if quick else ''}{seeds} seed(s) per cell, {records[0]['steps']} steps per run, "
             f"{len(records)} runs; on this machine the runs took {run_seconds:.0f} s in all "
             f"({run_seconds / max(len(records), 1):.0f} s per run)"
             + (f", {kept} of them kept from an earlier invocation into this folder" if kept else "")
             + f"; this invocation {elapsed:.0f} s, the SFT warm-up and the analysis included.")
    footer = spec.get("report_extra", "") + f"\n\nCommand: `jaxrl experiment {name}{' --quick' if quick else ''}" \
        f"{f' --steps {steps}' if steps else ''}`; thresholds: configs/experiments/{name}.yaml."
    path = report.write_report(out, experiment.title, scale, report.reward_table(records), claims, figures, footer)
    log(f"[experiment] {name}: report {path} ({elapsed:.0f} s)")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxrl experiment", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(EXPERIMENTS))
    parser.add_argument("--quick", action="store_true", help="one seed and the config's quick subset of cells")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    parser.add_argument("--out", default=None, help="output folder (default runs/experiments/NAME)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join("runs", "experiments", args.name)
    try:
        with RunLock(out):
            run(args.name, out, quick=args.quick, steps=args.steps)
    except InputError as e:
        print(f"jaxrl experiment: {e}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        print(f"jaxrl experiment: stopped by {signal.Signals(e.signum).name}; the same command continues the grid "
              f"(finished runs are kept, a run cut short starts afresh)", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
