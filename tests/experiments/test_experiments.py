"""Each experiment's ``--quick`` grid end to end, two RL steps per cell: the plumbing (runs through
the trainer, metrics per run, figures, report.md with a verdict per claim), not the results.

The quick grids are the configs' ``quick`` subsets (mismatch: clean and noise x none and seq-mis;
entropy: none and clip-cov; kl: k2-as-loss and k1-in-reward), one seed; the SFT warm-up is cut
to 20 steps here, and the data to 10 x 10 problems, so the file stays within a few minutes.
"""

import json
import os
import re

import pytest

from jaxrl.experiments import registry, runner

VERDICT = re.compile(r"^- \*\*(reproduced|not reproduced|inconclusive at this scale)\*\*: ", re.M)


@pytest.fixture
def tiny(monkeypatch):
    load = runner.load_spec

    def small(name):
        spec = load(name)
        spec["setup"] = {"max_operand": 10, "heldout": 16, "sft_steps": 20}
        spec["rl"] = {**spec["rl"], "rollout.prompts_per_step": 4, "rollout.group_size": 4, "eval.max_prompts": 8}
        spec["gradient_prompts"] = 4
        return spec

    monkeypatch.setattr(runner, "load_spec", small)


@pytest.mark.parametrize("name", sorted(registry.EXPERIMENTS))
def test_quick_grid_writes_runs_figures_and_verdicts(tiny, tmp_path, name):
    out = str(tmp_path / name)
    path = registry.run(name, out, quick=True, steps=2, log=lambda line: None)
    records = json.load(open(os.path.join(out, "runs.json")))
    expected = runner.cells(runner.load_spec(name), registry.EXPERIMENTS[name].axes, quick=True)
    assert [r["cell"] for r in records] == [c.name for c in expected]
    for record in records:
        assert os.path.getsize(record["metrics"]) > 0
    figures = os.listdir(os.path.join(out, "figures"))
    assert figures and all(f.endswith(".png") for f in figures)
    text = open(path).read()
    assert "QUICK RUN" in text and len(VERDICT.findall(text)) >= 2
    # The same command again into the same folder trains nothing: every run's record is kept.
    lines = []
    registry.run(name, out, quick=True, steps=2, log=lines.append)
    runs = [line for line in lines if " seed " in line]
    assert len(runs) == len(expected) and all("kept from an earlier run" in line for line in runs)
    again = json.load(open(os.path.join(out, "runs.json")))
    assert all(r["kept"] for r in again) and not any(r["kept"] for r in records)
    assert [{**r, "kept": False} for r in again] == records
    assert f"{len(expected)} of them kept from an earlier invocation" in open(path).read()
    # A record torn by a kill is not trusted: that run alone runs again.
    torn = os.path.join(out, "runs", *expected[-1].name.split("/"), "seed0", "record.json")
    with open(torn, "w") as f:
        f.write('{"cell": ')
    registry.run(name, out, quick=True, steps=2, log=lambda line: None)
    kept = [r["kept"] for r in json.load(open(os.path.join(out, "runs.json")))]
    assert kept == [True] * (len(expected) - 1) + [False]


def test_cli_lists_the_experiment_command():
    from jaxrl.cli import COMMANDS

    assert COMMANDS["experiment"][0] == "jaxrl.experiments.registry"
