"""Starting real JAX processes from a test: explicit environment, a free port, timeouts, no leftovers.

Tests use the ``processes`` fixture (conftest.py); the helpers are imported by name.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from suite_settings import KEPT_JAX_SETTINGS, xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(devices: int = 4) -> dict[str, str]:
    """This process's environment without distributed settings, with ``devices`` CPU devices (and the
    suite's compilation cache and compiler settings, tests/suite_settings.py)."""
    env = {k: v for k, v in os.environ.items()
           if k in KEPT_JAX_SETTINGS or not k.startswith(("JAX_", "JAXRL_", "SLURM_", "TPU_"))}
    env.update(
        XLA_FLAGS=xla_flags(devices),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


@dataclasses.dataclass
class Finished:
    returncode: int
    output: str


class Processes:
    """Starts commands in their own process groups; ``wait_all`` enforces a deadline; ``kill_all`` cleans up."""

    def __init__(self, tmp_path):
        self._tmp = tmp_path
        self._procs: list[tuple[subprocess.Popen, str]] = []
        self._started = 0  # names each process's log

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        log = str(self._tmp / f"process-{self._started}.log")
        self._started += 1
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs.append((proc, log))

    def start_group(self, argv: list[str], count: int = 2, ids: tuple[int, ...] | None = None,
                    devices: int = 4) -> None:
        """``argv`` as processes ``ids`` (default all) of a group of ``count`` on 127.0.0.1, ``devices`` CPU
        devices each."""
        port = free_port()
        for process_id in range(count) if ids is None else ids:
            self.start([*argv, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(count),
                        "--process-id", str(process_id)], child_env(devices))

    def start_workers(self, mode: str, out_dir, count: int = 2, extra: tuple[str, ...] = (),
                      ids: tuple[int, ...] | None = None) -> None:
        """``mlp_worker.py MODE OUT_DIR [extra]`` as a group (see ``start_group``)."""
        self.start_group([sys.executable, WORKER, mode, str(out_dir), *extra], count, ids)

    def wait_all(self, timeout_s: float) -> list[Finished]:
        deadline = time.monotonic() + timeout_s
        results = []
        for proc, log in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                outputs = "\n".join(f"--- {path}\n{open(path).read()[-3000:]}" for _, path in self._procs)
                pytest.fail(f"processes still running after {timeout_s} s; killed. Output:\n{outputs}")
            results.append(Finished(proc.returncode, open(log).read()))
        return results

    def forget(self) -> None:
        """Drops the finished processes, so the next ``wait_all`` waits for those started after."""
        self._procs = [(proc, log) for proc, log in self._procs if proc.poll() is None]

    def kill_all(self) -> None:
        for proc, _ in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
