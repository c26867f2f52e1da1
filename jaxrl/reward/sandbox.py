"""Reward functions in a worker process, each call under a wall-clock limit (``reward.timeout_s``).

``jaxrl.reward.build_router`` returns a ``SandboxedRewardRouter``: every reward call (the
built-in math, format and instructions rewards and ``kind: python`` user functions) runs in one
worker process. A call that runs past ``timeout_s`` is killed with its worker, reported
with the sample (``on_error``, the log) and counted (``ScoredBatch.timed_out``, unparsable,
score 0); a call that raises is reported as in-process (type and message); a call that
ends the worker (``os._exit``, a segfault in C code, the OOM killer) is reported and counted
as raised. After a kill or a death a fresh worker scores the samples that remain, so one
bad sample costs its own result and one worker start, never the run.

Why a process: a Python thread cannot be stopped from outside (there is no thread
kill; a stuck ``while True`` or a C call such as a catastrophic regex or a huge
``sympy.simplify`` keeps it, and its GIL, forever), and ``signal.alarm`` works only in the
main thread (the trainer may score from another) and is not delivered while a C loop
holds the interpreter. Killing a process always works, and it also survives crashes.

How: the worker is started lazily at the first ``score`` and reused for every batch. It is
a fresh interpreter (``subprocess`` with ``python -c``: exec, never ``fork``, which is unsafe
in the multithreaded JAX trainer), not ``multiprocessing``'s spawn, because spawn re-imports
the parent's ``__main__`` in the child (a user's training script without an
``if __name__ == "__main__"`` guard would start training again in the worker). The parent
sends its ``sys.path`` and the picklable ``TaskRewardConfig``s; the worker builds the reward
functions itself (``kind: python`` ones are imported there by their "module:callable"
spec; the parent imports them too, at build time, so a bad spec fails before training
as a ValueError naming it). A whole batch goes over as one message and the results
stream back one per sample; each sample's limit counts from the previous result. The worker
runs in a PID namespace of its own where the machine allows (``jaxrl.sandbox.contain``: the
host's files, network and identity, so rewards work as before), so every process a reward
starts, ``setsid`` or not, ends with the worker; elsewhere in its own process group (a kill
takes its subprocesses, but not those that left the session; a warning says so). It ignores
SIGINT (Ctrl-C is the trainer's to handle) and exits when the trainer's process goes away. It runs with
``JAX_PLATFORMS=cpu``: a reward that imports JAX must not take the trainer's accelerator
(a TPU admits one process). ``close()`` stops it; a finalizer kills it at interpreter exit
if ``close`` was never called.

Limits: each sample is tried once, so a reward that hangs on every sample costs
``N * timeout_s`` per batch (each reported). A ``kind: python`` function must live in an
importable module: "__main__:fn" is refused at build time.

Costs measured (2-core CPU container, Python 3.11, other jobs running): a worker starts in
0.25-0.5 s (the interpreter and ``jaxrl.reward``, whose sympy import dominates; plus what
a ``kind: python`` module imports), once per run and once per killed or dead worker.
A batch of 256 math rewards (``\\boxed{}`` answers against references, sympy comparisons)
takes 28 ms in the warm worker vs 19 ms in-process (median of 15), i.e. about 35 us of IPC per
sample; 256 trivial ``kind: python`` rewards take 3 ms vs 0.4 ms (about 10 us per sample).
Next to a training step (seconds) that is noise.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Mapping

from jaxrl.errors import InputError
from jaxrl.reward.base import Outcome, RewardRouter, call_reward, describe_exception
from jaxrl.reward.tasks import TaskRewardConfig, build_reward
from jaxrl.process_groups import kill_group
from jaxrl.sandbox import check_seconds, command_status, contain

log = logging.getLogger(__name__)

# The worker's entry: a fresh interpreter, given the parent's sys.path before importing anything of ours.
_BOOT = (
    "import os, sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from jaxrl.reward.sandbox import serve\n"
    "serve(conn)\n"
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "os._exit(0)\n"  # do not wait for threads a reward function may have left behind
)


# What a reward function prints reaches the trainer's terminal, at most this much per sample: one
# that prints each response (or loops printing) would otherwise bury the run's log.
MAX_OUTPUT_CHARS = 2000


# ------------------------------------------------------------------------------- the worker side
class _CappedOutput(io.TextIOBase):
    """``sys.stdout`` and ``sys.stderr`` of the worker: writes pass to ``target`` until a sample has
    written ``limit`` characters; the rest is counted and reported in one line after the sample."""

    def __init__(self, target, limit: int):
        self.target, self.limit = target, limit
        self.left, self.dropped = limit, 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        kept = text[:max(self.left, 0)]
        self.left -= len(kept)
        self.dropped += len(text) - len(kept)
        self.target.write(kept)
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def next_sample(self) -> None:
        if self.dropped:
            self.target.write(f"\n[jaxrl reward worker: {self.dropped:,} more characters of a reward's output "
                              f"dropped (at most {self.limit:,} per sample)]\n")
        self.target.flush()
        self.left, self.dropped = self.limit, 0


def serve(conn: Connection) -> None:
    """The worker's loop: build the reward functions, then score batches until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    os.dup2(2, 1)  # the trainer's stdout carries its JSON summary; a reward's output goes to stderr
    sys.stdout = sys.stderr = output = _CappedOutput(sys.__stderr__, MAX_OUTPUT_CHARS)
    try:
        tasks = conn.recv()
        functions = {name: build_reward(task, f"reward.tasks.{name}.function") for name, task in tasks.items()}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it.
        conn.send(("start_error", describe_exception(e)))
        return
    conn.send(("ready", os.getpid()))
    try:
        while True:
            message = conn.recv()
            if message[0] == "close":
                return
            _, batch, items = message
            for i, task, prompt, response, response_ids, row in items:
                try:
                    outcome = call_reward(functions[task], prompt, response, response_ids, row)
                except BaseException as e:  # noqa: BLE001 - SystemExit / KeyboardInterrupt in a reward function.
                    outcome = Outcome("raised", error=describe_exception(e))
                output.next_sample()
                conn.send((batch, i, tuple(outcome)))
    except (EOFError, OSError):  # the parent closed its end or went away
        return


def _exit_with_parent(parent: int) -> None:
    """Ends the worker when the trainer's process is gone, even while a reward function loops."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


# ------------------------------------------------------------------------------- the parent side
class WorkerStartError(RuntimeError):
    """The reward worker process could not start or build the reward functions."""


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, tasks: Mapping, start_timeout_s: float):
        parent_end, child_end = Pipe(duplex=True)
        try:
            command, self.contained = contain([sys.executable, "-c", _BOOT, str(child_end.fileno())],
                                              "the reward worker")
            self.proc = subprocess.Popen(
                command, pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, process_group=0,
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self.conn = parent_end
        self.pid = self.proc.pid
        self._finalizer = weakref.finalize(self, _kill, self.proc, self.conn)
        try:
            self.conn.send(list(sys.path))
            self.conn.send(dict(tasks))
            message = self.recv(start_timeout_s)
        except (EOFError, OSError):
            message = ("died",)
        if message is None or message[0] != "ready":
            if message is None:
                why = f"did not become ready within {start_timeout_s:g}s"
            elif message[0] == "start_error":
                why = f"could not build the reward functions: {message[1]}"
            else:
                why = f"exited while starting ({self.stop_reason()})"
            self.kill()
            raise WorkerStartError(f"the reward worker process (pid {self.pid}) {why}")

    def recv(self, timeout: float):
        """The next message, or None after ``timeout`` seconds; EOFError/OSError when the worker is gone."""
        if not self.conn.poll(max(0.0, timeout)):
            return None
        return self.conn.recv()

    def stop_reason(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "pipe closed, process still running"
        if self.contained:
            code = command_status(code)
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self._finalizer()

    def close(self, wait_s: float = 2.0) -> None:
        """Asks the worker to exit; kills it if it does not within ``wait_s``."""
        if self._finalizer.alive and self.alive():
            try:
                self.conn.send(("close",))
                self.proc.wait(timeout=wait_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._finalizer()


def _kill(proc: subprocess.Popen, conn: Connection) -> None:
    """Kills the worker and its process group, reaps it, closes the pipe (also the finalizer at exit)."""
    if proc.poll() is None:
        kill_group(proc)
    conn.close()


class SandboxedRewardRouter(RewardRouter):
    """A ``RewardRouter`` whose functions run in a worker process, each call under ``timeout_s``.

    tasks: task name -> ``TaskRewardConfig`` (the worker builds the functions from these).
    The functions are also built here at construction, so a bad ``kind: python`` spec
    or regex fails now, naming it. ``answer_fields`` (for ``row_problem``) are the math
    tasks' ``answer_field``. ``start_timeout_s``: how long a worker may take to start.
    ``close()`` (or ``with``) stops the worker; a later ``score`` starts a new one. ``scorers``: the
    batch scorers of the judge and code tasks (``RewardRouter``); their samples never reach the worker.
    """

    def __init__(
        self,
        tasks: Mapping,
        task_field: str = "task",
        default_task: str | None = None,
        timeout_s: float = 10.0,
        start_timeout_s: float = 120.0,
        scorers=(),
    ):
        check_seconds("SandboxedRewardRouter timeout_s", timeout_s)
        check_seconds("SandboxedRewardRouter start_timeout_s", start_timeout_s)
        for name, task in tasks.items():
            if not isinstance(task, TaskRewardConfig):
                raise TypeError(
                    f"SandboxedRewardRouter task {name!r} must be a TaskRewardConfig, got {type(task).__name__}"
                )
            if task.kind == "python" and task.function.partition(":")[0] == "__main__":
                raise InputError(
                    f"reward function {task.function!r} (task {name!r}) lives in the script being run; the reward "
                    f"worker process cannot import it: move it to an importable module and name that module"
                )
        super().__init__(
            {name: build_reward(task, f"reward.tasks.{name}.function") for name, task in tasks.items()},
            task_field=task_field,
            default_task=default_task,
            answer_fields={name: task.answer_field for name, task in tasks.items() if task.kind == "math"},
            scorers=scorers,
        )
        self.tasks = dict(tasks)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.worker_starts = 0  # how many worker processes were started (restarts = this - 1)
        self._worker: _Worker | None = None
        self._batches = 0
        self._lock = threading.Lock()

    @property
    def worker_pid(self) -> int | None:
        """The pid of the running worker process, or None when none is running."""
        worker = self._worker
        return worker.pid if worker is not None and worker.alive() else None

    def close(self) -> None:
        """Stops the worker process, if any, and the judge's models; idempotent."""
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None
        super().close()

    def _ensure_worker(self) -> _Worker:
        if self._worker is not None and not self._worker.alive():
            self._worker.kill()
            self._worker = None
        if self._worker is None:
            t = time.perf_counter()
            self._worker = _Worker(self.tasks, self.start_timeout_s)
            self.worker_starts += 1
            log.debug("reward worker %d started in %.2fs", self._worker.pid, time.perf_counter() - t)
        return self._worker

    def _drop_worker(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def _call_all(self, tasks, prompts, responses, response_ids, rows) -> list[Outcome]:
        items = [
            (i, task, prompts[i], responses[i], response_ids[i], row if isinstance(row, dict) else dict(row))
            for i, (task, row) in enumerate(zip(tasks, rows, strict=True))
        ]
        outcomes: list[Outcome | None] = [None] * len(items)
        with self._lock:
            try:
                self._run(items, outcomes)
            except BaseException:  # a half-read batch must not leak into the next one
                self._drop_worker()
                raise
        return outcomes

    def _run(self, items: list, outcomes: list) -> None:
        """Scores ``items`` in the worker; after a timeout or a death, the rest in a fresh one."""
        pending, send_failures = items, 0
        while pending:
            worker = self._ensure_worker()
            self._batches += 1
            batch = self._batches
            try:
                worker.conn.send(("score", batch, pending))
            except OSError as e:  # the worker died while idle; start another, but do not loop forever
                self._drop_worker()
                send_failures += 1
                if send_failures >= 3:
                    raise WorkerStartError("the reward worker process keeps dying before it receives a batch") from e
                continue
            done = 0
            for i, *_ in pending:
                try:
                    message = worker.recv(self.timeout_s)
                except (EOFError, OSError):
                    outcomes[i] = Outcome("died", error=worker.stop_reason())
                    break
                if message is None:
                    outcomes[i] = Outcome("timed_out")
                    break
                if message[0] != batch or message[1] != i:
                    raise RuntimeError(f"reward worker protocol error: expected sample {i} of batch {batch}, "
                                       f"got sample {message[1]} of batch {message[0]}")
                outcomes[i] = Outcome(*message[2])
                done += 1
            else:
                return
            self._drop_worker()
            pending = pending[done + 1:]
