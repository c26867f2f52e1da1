"""A run's life outside the step itself: claiming its folders, stopping on a signal, saving at the end.

- A fresh start never destroys an earlier run: ``check_fresh_start`` refuses when the output
  folder holds metrics or the checkpoint folder holds checkpoints, unless the caller resumes
  or asked to overwrite (``open_run`` then removes them, once the trainer has loaded
  everything that can fail on a bad value, so such a start touches no existing file).
- SIGTERM (preemption) and SIGINT (Ctrl-C) do not kill a step half-way: ``StopSignals`` turns
  them into a request that the loop honours after the current step, by writing a checkpoint,
  flushing the metrics and raising ``TrainingInterrupted`` (the CLIs exit ``128 + signal``,
  the shell's convention for "killed by that signal"). A second Ctrl-C stops at once. With
  several processes, the request is shared: every process stops after the same step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import threading
import traceback
from typing import Any, Callable

import jax
import numpy as np

from jaxrl.errors import InputError
from jaxrl.trainer.checkpoint import Checkpointer
from jaxrl.trainer.export import export_hf
from jaxrl.trainer.metrics import MetricsLogger, read_jsonl
from jaxrl.trainer.plots import fit_run_entropy_law, plot_run

log = logging.getLogger(__name__)

# What a run writes into its output folder (the metrics logger, plots, batch dumps, the judges' cache).
_RUN_OUTPUTS = ("metrics.jsonl", "tb", "plots", "batches", "judge_cache")


class RunExistsError(InputError):
    """A fresh start would overwrite an earlier run's metrics or checkpoints."""


class TrainingInterrupted(Exception):
    """The run stopped on a signal after ``step``, with its state saved (when checkpoints are on)."""

    def __init__(self, signum: int, step: int, checkpoint_directory: str):
        self.signum, self.step, self.checkpoint_directory = signum, step, checkpoint_directory
        name = signal.Signals(signum).name
        where = (f"checkpoint of step {step} saved in {checkpoint_directory}; continue with --resume"
                 if checkpoint_directory else "checkpoint.directory is empty, so nothing was saved to resume from")
        super().__init__(f"stopped by {name} after step {step}; {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _checkpoint_steps(directory: str) -> list[str]:
    """Names of the step folders (digits only) in a checkpoint directory, local or remote."""
    if not directory:
        return []
    if "://" in directory:
        from etils import epath

        path = epath.Path(directory)
        return sorted(p.name for p in path.iterdir() if p.name.isdigit()) if path.exists() else []
    if not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory) if name.isdigit())


def previous_run(output_dir: str, checkpoint_directory: str) -> list[str]:
    """What an earlier run left that a fresh start would overwrite: metrics and checkpoint steps."""
    found = []
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append(metrics)
    steps = _checkpoint_steps(checkpoint_directory)
    if steps:
        found.append(f"{checkpoint_directory} (checkpoint steps {', '.join(steps)})")
    return found


def check_fresh_start(output_dir: str, checkpoint_directory: str, *, resume: bool, overwrite: bool) -> None:
    """Refuses (RunExistsError) to start afresh over an earlier run, unless resuming or overwriting;
    refuses to resume without a checkpoint folder to resume from (InputError)."""
    if resume and not checkpoint_directory:
        raise InputError("--resume needs checkpoint.directory (empty in this config): set it to the folder the run "
                         "saved its checkpoints in, e.g. checkpoint.directory=runs/x/checkpoints")
    if resume or overwrite:
        return
    found = previous_run(output_dir, checkpoint_directory)
    if found:
        raise RunExistsError(
            f"an earlier run is in the way: {'; '.join(found)}. Continue it with --resume, choose another "
            f"output_dir / checkpoint.directory, or pass --overwrite to delete it and start afresh")


def clear_previous_run(output_dir: str, checkpoint_directory: str) -> None:
    """Deletes an earlier run's metrics, TensorBoard events, plots, batch dumps, judge cache and
    checkpoints; says so when there was a run (metrics or checkpoints) to delete."""
    found = previous_run(output_dir, checkpoint_directory)
    for name in _RUN_OUTPUTS:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    if "://" in checkpoint_directory:
        from etils import epath

        path = epath.Path(checkpoint_directory)
        if path.exists():
            path.rmtree()
    elif checkpoint_directory and os.path.isdir(checkpoint_directory):
        shutil.rmtree(checkpoint_directory)
    if found:
        log.warning("--overwrite: deleted the earlier run in %s%s", output_dir,
                    f" and {checkpoint_directory}" if checkpoint_directory else "")


class RunLockedError(InputError):
    """Another process is running in the same ``output_dir``."""


def _unwritable(folder: str, error: OSError, key: str = "output_dir") -> InputError:
    return InputError(f"cannot write in {key}={folder}: {error.strerror or error}; choose a folder this user "
                      f"can write, with free space")


def check_writable(folder: str, key: str) -> None:
    """Makes a local ``folder`` and writes a file in it, so a folder this user cannot write (or a
    full disk) is named under its config ``key`` before the first step, not in a traceback from
    the first save. A URL (``gs://``) is left to its storage client."""
    if "://" in folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(b"jaxrl")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        raise _unwritable(folder, e, key) from None


class RunLock:
    """Context manager: holds ``output_dir/run.lock`` for the run, so a second run on the same
    folder (two launches of one command, a retry while the first still runs) is refused at once
    instead of both writing the metrics and the checkpoints.

    The lock is ``flock`` on the file, which the kernel releases when the process ends however it
    ends (SIGKILL and OOM included): a file left by a dead run is never in the way, and there is
    no stale lock to break. The file holds the holder's pid, host and start time, for the
    message. ``flock`` is local to a host; on NFS and most network file systems it is not shared
    between hosts, so two hosts can still start runs on one shared folder. With several JAX
    processes each holds its own folder (``process-<i>`` below the main one's).
    """

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, "run.lock")
        self._file = None

    def __enter__(self) -> "RunLock":
        import fcntl

        folder = os.path.dirname(self.path)
        try:
            os.makedirs(folder, exist_ok=True)
            handle = open(self.path, "a+")
        except OSError as e:
            raise _unwritable(folder, e) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that has not written its name yet"
            handle.close()
            raise RunLockedError(f"another run is using {folder} ({holder}, holding {self.path}); wait for it "
                                 f"to end or choose another output_dir") from None
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            handle.flush()
        except OSError as e:
            with contextlib.suppress(OSError):  # closing flushes the line that did not fit
                handle.close()
            raise _unwritable(folder, e) from None
        self._file = handle
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the flock
            self._file = None


class StopSignals:
    """Context manager: SIGTERM/SIGINT set a stop request instead of killing the process.

    ``requested()`` is called between steps; it returns the signal number (agreed by every
    process) or None. Handlers are installed only in the main thread (Python delivers signals
    there); elsewhere the default behaviour stays. A second SIGINT raises KeyboardInterrupt.
    A run still going ``timeout_s`` after the first signal is stuck where no step boundary comes
    (a reward or server that never answers, a write that blocks): a watchdog thread then prints
    where the main thread is and ends the process with ``128 + signal``, without saving.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, timeout_s: float = 600.0):
        self.signum: int | None = None
        self.timeout_s = timeout_s
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = self.signum is None
        self.signum = signum
        log.warning("received %s: finishing the current step, then saving and stopping (Ctrl-C again stops now)",
                    signal.Signals(signum).name)
        if first:
            self._watchdog = threading.Timer(self.timeout_s, self._give_up, args=(signum, threading.get_ident()))
            self._watchdog.daemon = True
            self._watchdog.start()

    def _give_up(self, signum: int, main_thread: int) -> None:
        frame = sys._current_frames().get(main_thread)
        where = "unknown"
        if frame is not None:
            stack = traceback.extract_stack(frame)
            ours = [f for f in stack if f"{os.sep}jaxrl{os.sep}" in f.filename] or stack
            where = f"{ours[-1].filename}:{ours[-1].lineno} in {ours[-1].name}"
        print(f"jaxrl: still running {self.timeout_s:g} s after {signal.Signals(signum).name} "
              f"(checkpoint.stop_timeout_s), stuck at {where}; exiting without saving: --resume continues from "
              f"the last checkpoint", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def requested(self) -> int | None:
        local = self.signum or 0
        if jax.process_count() > 1:
            # Each process may see the signal at a different step: stop together, after the same step.
            from jax.experimental import multihost_utils

            local = int(np.max(multihost_utils.process_allgather(np.int32(local))))
        return local or None


def open_run(config, *, resume: bool, overwrite: bool):
    """Readies a validated run's folders (the trainer calls it once everything that can fail on a
    bad value has loaded): clears an earlier run when overwriting, makes ``output_dir``, and
    returns the run's Checkpointer (None when ``checkpoint.directory`` is empty)."""
    if overwrite and not resume:
        clear_previous_run(config.output_dir, config.checkpoint.directory)
    os.makedirs(config.output_dir, exist_ok=True)
    if not config.checkpoint.directory:
        return None
    check_writable(config.checkpoint.directory, "checkpoint.directory")
    return Checkpointer(config.checkpoint)


def end_step(stop: StopSignals, checkpointer: Checkpointer | None, step: int, save: Callable[[], None],
             final: bool) -> None:
    """What the loop does after each step is logged: save on the ``checkpoint.every`` schedule and
    after the ``final`` step, surface a failed background save at once (CheckpointSaveError), and
    on a stop request save (unless this step was just saved), wait for the write and raise
    TrainingInterrupted."""
    if checkpointer is None:
        signum = stop.requested()
        if signum is not None:
            raise TrainingInterrupted(signum, step, "")
        return
    saved = final or checkpointer.should_save(step)
    if saved:
        save()
    checkpointer.check_for_errors()
    signum = stop.requested()
    if signum is None:
        return
    if not saved:
        save()
    checkpointer.wait()
    raise TrainingInterrupted(signum, step, checkpointer.directory)


# The key of a few held-out completions in what ``evaluate`` returns (a tuple of dicts, not a metric).
COMPLETIONS = "heldout/completions"


def _keep_completions(logger: MetricsLogger, step: int, metrics: dict) -> None:
    """Takes the completions out of an evaluation's ``metrics``; process 0 keeps them, as it keeps
    TensorBoard and the plots (the others log only their own JSONL of scalars)."""
    completions = metrics.pop(COMPLETIONS, ())
    if jax.process_index() == 0:
        logger.completions(step, completions)


def run_loop(trainer, total_steps: int, evaluate: Callable[[], dict] | None = None) -> dict[str, Any]:
    """A trainer's run to ``total_steps``, RL and SFT alike; returns the summary.

    ``trainer`` has ``config``, ``step``, ``train_step_once()`` (the metrics of one step),
    ``errors`` (lines for the log, emptied after each step), ``checkpointer``, ``save()`` and
    ``model()``. Per step: the metrics to JSONL, TensorBoard and the progress, the step's
    messages, a checkpoint on schedule, a stop on a signal after the current step. With
    ``evaluate`` (held-out metrics, and under ``COMPLETIONS`` a few completions for
    ``completions.jsonl`` and TensorBoard), an evaluation before the first step of a fresh run, every
    ``eval.every`` steps and after the last. At the end: the checkpoint written, the HF export
    (``checkpoint.export_hf``), the plots and, when the run logged entropy and reward, the
    entropy-performance law fitted to them."""
    config = trainer.config
    logger = MetricsLogger(config.output_dir, total_steps, start_step=trainer.step,
                           progress=config.logging.progress, tensorboard=config.logging.tensorboard)
    summary: dict[str, Any] = {}
    try:
        with StopSignals(config.checkpoint.stop_timeout_s) as stop:
            if trainer.step == 0 and evaluate is not None:
                start = evaluate()
                summary["heldout_start"] = start.get("heldout/reward")
                _keep_completions(logger, 0, start)
                logger.log(0, start)
            while trainer.step < total_steps:
                metrics = trainer.train_step_once()
                final = trainer.step == total_steps
                if evaluate is not None and (final or (config.eval.every and trainer.step % config.eval.every == 0)):
                    metrics.update(evaluate())
                    _keep_completions(logger, trainer.step, metrics)
                logger.log(trainer.step, metrics)
                for message in trainer.errors:
                    logger.write(message if message.startswith("step ") else f"step {trainer.step}: {message}")
                trainer.errors.clear()
                end_step(stop, trainer.checkpointer, trainer.step, trainer.save, final)
        if trainer.checkpointer is not None:
            trainer.checkpointer.wait()
        if config.checkpoint.export_hf:
            export_hf(trainer.model(), trainer.tokenizer, config.model.hf_path, config.checkpoint.export_hf)
            summary["hf_export"] = config.checkpoint.export_hf
    finally:
        logger.close()
    rows = read_jsonl(logger.jsonl_path)
    heldout = [row["heldout/reward"] for row in rows if row.get("heldout/reward") is not None]
    if heldout:
        summary.setdefault("heldout_start", heldout[0])
        summary["heldout_end"] = heldout[-1]
    if config.logging.plots:
        summary["plots"] = plot_run(rows, os.path.join(config.output_dir, "plots"))
    fit = fit_run_entropy_law(rows)
    if fit is not None:
        summary["entropy_law"] = {k: fit[k] for k in ("a", "b", "ceiling", "ceiling_beyond_range", "rmse")}
    summary["metrics"] = logger.jsonl_path
    return summary
