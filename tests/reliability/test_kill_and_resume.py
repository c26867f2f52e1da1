"""Fault injection: ``jaxrl train`` killed and resumed ends bit for bit where the straight run ends.

Each run is a real ``jaxrl train`` process on the tiny RL config of conftest.py (6 steps);
the final parameters (the run's Hugging Face export) and every metrics row are compared
with an uninterrupted run, bit for bit (timings aside).
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl.trainer.metrics import read_jsonl

STEPS = 6
TIMEOUT_S = 600


def _command(config_path, *extra):
    jaxrl = os.path.join(os.path.dirname(sys.executable), "jaxrl")
    return [jaxrl, "train", str(config_path), *extra]


def _write_config(run_config, folder, every):
    folder.mkdir(parents=True, exist_ok=True)
    data = run_config(folder / "out", steps=STEPS, checkpoint={
        "directory": str(folder / "ck"), "every": every, "keep": 3, "export_hf": str(folder / "hf")})
    path = folder / "config.json"
    path.write_text(json.dumps(data))
    return path


def _start(config_path, *extra):
    return subprocess.Popen(_command(config_path, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    return process.returncode, stderr


def _wait_until(process, condition, what, poll_s=0.02):
    """Polls ``condition()`` every ``poll_s`` seconds until true; fails if the run ends first."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended (status {process.returncode}) before {what}: {process.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll_s)


def _logged_step(folder, step):
    def condition():
        return any(row["step"] >= step for row in read_jsonl(str(folder / "out" / "metrics.jsonl")))
    return condition


def _comparable_rows(folder):
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in read_jsonl(str(folder / "out" / "metrics.jsonl"))]


def _assert_same_run(straight, other):
    assert [r["step"] for r in _comparable_rows(other)] == list(range(1, STEPS + 1))
    assert _comparable_rows(other) == _comparable_rows(straight)
    a, b = load_file(str(straight / "hf" / "model.safetensors")), load_file(str(other / "hf" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def straight(run_config, tmp_path_factory):
    """The uninterrupted run, shared by the tests of this module."""
    folder = tmp_path_factory.mktemp("straight")
    status, stderr = _finish(_start(_write_config(run_config, folder, every=STEPS)))
    assert status == 0, stderr[-2000:]
    return folder


def test_sigterm_at_a_random_step_then_resume_is_bit_exact(run_config, straight, tmp_path):
    """Before: SIGTERM (preemption) or Ctrl-C killed the run where it stood: up to
    ``checkpoint.every - 1`` finished steps were lost, and the exit status did not say why.

    The signal arrives after a random step (seeded) between two checkpoints; the run finishes
    the step it is in, saves, flushes its metrics and exits 143 (128 + SIGTERM), and
    ``--resume`` ends bit for bit where the uninterrupted run ends.
    """
    config = _write_config(run_config, tmp_path, every=4)
    signal_after = random.Random(11).randint(1, 3)  # before the run's only scheduled save (step 4)
    process = _start(config)
    _wait_until(process, _logged_step(tmp_path, signal_after), f"step {signal_after} was logged")
    process.send_signal(signal.SIGTERM)
    status, stderr = _finish(process)
    assert status == 128 + signal.SIGTERM, stderr[-2000:]
    stopped = [row["step"] for row in read_jsonl(str(tmp_path / "out" / "metrics.jsonl"))][-1]
    assert stopped < STEPS and f"stopped by SIGTERM after step {stopped}" in stderr
    assert sorted(os.listdir(tmp_path / "ck")) == [str(stopped)]  # saved off the every-4 schedule

    status, stderr = _finish(_start(config, "--resume"))
    assert status == 0, stderr[-2000:]
    _assert_same_run(straight, tmp_path)


def test_sigkill_during_an_asynchronous_save_then_resume_is_bit_exact(run_config, straight, tmp_path):
    """Before (the defect class): a process killed while Orbax wrote a checkpoint in the background
    could leave a half-written latest checkpoint that ``--resume`` then tripped over.

    The run saves every step; it is SIGKILLed while a save's temporary folder exists (a save in
    flight, after at least one complete save). ``--resume`` ignores the incomplete save, restores
    the newest complete step, drops the metrics rows after it, and ends bit for bit where the
    uninterrupted run ends.
    """
    config = _write_config(run_config, tmp_path, every=1)
    ck = tmp_path / "ck"
    process = _start(config)

    def saving_after_a_complete_save():
        names = os.listdir(ck) if ck.is_dir() else []
        return any(n.isdigit() for n in names) and any("tmp" in n for n in names)

    # a save is in flight for milliseconds: poll fast (a listdir is cheap, unlike re-reading the metrics)
    _wait_until(process, saving_after_a_complete_save, "a save was in flight", poll_s=0.0005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    left = os.listdir(ck)
    assert any("tmp" in n for n in left), f"the kill came after the save completed: {left}"
    complete = max(int(n) for n in left if n.isdigit())
    assert complete < STEPS

    status, stderr = _finish(_start(config, "--resume"))
    assert status == 0, stderr[-2000:]
    _assert_same_run(straight, tmp_path)


@pytest.fixture(scope="module")
def stopping_model(run_config, tmp_path_factory):
    """The tiny model as a checkpoint whose responses end at any of four ids, so sample lengths
    spread and partial rollouts carry unfinished groups from step to step."""
    from jaxrl.models import ModelConfig
    from jaxrl.rollout.sglang.testing import write_random_checkpoint

    path = tmp_path_factory.mktemp("stopping") / "hf"
    architecture = run_config(path)["model"]["architecture"]
    write_random_checkpoint(str(path), ModelConfig(**{**architecture, "max_position_embeddings": 64}), seed=2,
                            matrix_scale=1.0)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4, 5, 6]}))
    return str(path)


def _partial_config(run_config, folder, model):
    """2 tokens per round of up to 10-token responses: groups take several rounds, and those
    unfinished when a step has its batch carry into the next (rollout.partial_tokens)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = run_config(folder / "out", steps=STEPS, checkpoint={
        "directory": str(folder / "ck"), "every": 2, "keep": 3, "export_hf": str(folder / "hf")},
        rollout={"group_size": 2, "max_new_tokens": 10, "partial_tokens": 2})
    data["model"] = {"hf_path": model}
    path = folder / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_sigkill_with_partial_rollouts_in_flight_then_resume_is_bit_exact(run_config, stopping_model, tmp_path):
    """Not probed before: the checkpoint of a partial-rollout run holds the groups in flight (their
    tokens, versions and behaviour logprobs so far). SIGKILL after a step past a checkpoint; the
    resumed run continues those groups and ends bit for bit where the uninterrupted run ends."""
    straight = tmp_path / "straight"
    status, stderr = _finish(_start(_partial_config(run_config, straight, stopping_model)))
    assert status == 0, stderr[-2000:]
    rows = _comparable_rows(straight)
    assert all(r["rollout/partial_in_flight"] > 0 for r in rows if r["step"] in (2, 4))  # carried at each save

    killed = tmp_path / "killed"
    config = _partial_config(run_config, killed, stopping_model)
    process = _start(config)
    _wait_until(process, _logged_step(killed, 3), "step 3 was logged")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert max(int(n) for n in os.listdir(killed / "ck") if n.isdigit()) < STEPS
    status, stderr = _finish(_start(config, "--resume"))
    assert status == 0, stderr[-2000:]
    _assert_same_run(straight, killed)
