"""Processes a ``kind: python`` reward starts end with the run (docs/reliability.md).

Before: the reward worker ran in a process group of its own, so a child that called ``setsid``
escaped the kill, and a plain child of a worker that exited normally was orphaned; a reward
that forked a sleeping child on every call left 16 processes behind after ``jaxrl train``
exited 0. The worker now runs in a PID namespace of its own (``jaxrl.sandbox.contain``): when
it ends, the kernel ends everything it started.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from jaxrl.config import from_dict
from jaxrl.reward import RewardConfig, build_router
from jaxrl.sandbox import probe

pytestmark = pytest.mark.skipif(probe().jail is None, reason=f"no jail on this machine: {probe().describe()}")

REWARD_MODULE = textwrap.dedent("""
    import os, subprocess
    from jaxrl.reward import RewardResult

    def spawning_reward(prompt, response, response_ids, row):
        marker = os.environ["JAXRL_TEST_MARKER"]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # never holds the trainer's pipes
        subprocess.Popen(["setsid", "sleep", marker], **quiet)  # leaves the worker's session
        subprocess.Popen(["sleep", marker], **quiet)            # an ordinary child, orphaned when the worker ends
        return RewardResult(float(response[:1].isdigit()))
""")


def _processes_with(marker: str, within_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + within_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmdline and state != "Z":
                found.append(f"{pid}: {cmdline}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    folder = tmp_path / "rewards"
    folder.mkdir()
    (folder / "spawning_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    marker = f"86397.{os.getpid() % 10000}"
    monkeypatch.setenv("JAXRL_TEST_MARKER", marker)
    return folder, marker


def test_closing_the_router_ends_what_its_rewards_started(reward_module):
    _, marker = reward_module
    router = build_router(from_dict(RewardConfig, {"default_task": "t", "tasks": {
        "t": {"kind": "python", "function": "spawning_rewards:spawning_reward"}}}))
    try:
        out = router.score(["p"] * 3, ["1", "x", "2"], [[1]] * 3, [{}] * 3)
        assert out.scores.tolist() == [1.0, 0.0, 1.0]
        assert len(_processes_with(marker, within_s=0)) == 6  # alive while the worker is
    finally:
        router.close()
    assert _processes_with(marker) == []


def test_no_reward_started_process_survives_the_run(reward_module, run_config, tmp_path):
    folder, marker = reward_module
    config = run_config(tmp_path / "out", steps=2, reward={
        "default_task": "t", "task_field": "none",
        "tasks": {"t": {"kind": "python", "function": "spawning_rewards:spawning_reward"}}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}
    done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", str(path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _processes_with(marker) == []
