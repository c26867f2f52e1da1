"""``jaxrl experiment`` under faults, as a user meets them: killed mid-grid, stopped by SIGTERM,
started twice into one folder. Each through the command in a subprocess, on the entropy
experiment's quick grid (cells ``none`` and ``clip-cov``, one seed) cut to the sizes of
test_experiments.py so a grid takes well under a minute.
"""

import json
import os
import signal
import subprocess
import sys
import time

# The command with the test's small spec: runner.load_spec patched in the child, then the CLI.
COMMAND = """
import sys
from jaxrl.experiments import registry, runner
load = runner.load_spec
def small(name):
    spec = load(name)
    spec["setup"] = {"max_operand": 10, "heldout": 16, "sft_steps": 20}
    spec["rl"] = {**spec["rl"], "rollout.prompts_per_step": 4, "rollout.group_size": 4, "eval.max_prompts": 8}
    return spec
runner.load_spec = small
sys.exit(registry.main(sys.argv[1:]))
"""


def _start(out) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", COMMAND, "entropy", "--quick", "--steps", "3", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path, run: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)


def _steps(metrics: str) -> list[int]:
    return [json.loads(line)["step"] for line in open(metrics)]


def test_a_grid_killed_mid_run_continues_where_it_stopped(tmp_path):
    """SIGKILL while the second cell trains (its metrics have begun); the same command then keeps
    the first cell's run, trains the second afresh (its metrics hold each step once) and writes
    the report."""
    out = tmp_path / "grid"
    second = out / "runs" / "clip-cov" / "seed0"
    run = _start(out)
    _wait_for(second / "metrics.jsonl", run)
    run.kill()
    run.wait()
    assert not (second / "record.json").exists() and not (out / "runs.json").exists()
    again = _start(out)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr
    assert "none seed 0" in stdout and "(kept from an earlier run into this folder)" in stdout.split("none seed 0")[1]
    assert "kept" not in stdout.split("clip-cov seed 0")[1].splitlines()[0]
    records = json.load(open(out / "runs.json"))
    assert [(r["cell"], r["kept"]) for r in records] == [("none", True), ("clip-cov", False)]
    assert _steps(second / "metrics.jsonl") == [0, 1, 2, 3]  # held-out at 0, then each step once
    assert "1 of them kept from an earlier invocation" in open(out / "report.md").read()


def test_sigterm_stops_the_grid_in_one_line_and_a_second_invocation_is_refused(tmp_path):
    """Before: SIGTERM ended the experiment with a TrainingInterrupted traceback (exit 1), and two
    invocations into one folder both trained the same runs."""
    out = tmp_path / "grid"
    run = _start(out)
    _wait_for(out / "runs" / "none" / "seed0" / "metrics.jsonl", run)
    second = _start(out)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2, err
    assert err.strip().splitlines()[-1].startswith(f"jaxrl experiment: another run is using {out} (pid {run.pid} ")
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last == ("jaxrl experiment: stopped by SIGTERM; the same command continues the grid (finished runs are "
                    "kept, a run cut short starts afresh)"), err
    assert "Traceback" not in err
