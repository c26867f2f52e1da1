"""Per-step metrics to TensorBoard event files, a JSONL log and the progress (a bar on a terminal,
a plain line every few steps in a log file).

The JSONL file holds one object per step: ``{"step": k, "<name>": value, ...}``.
On resume, lines of steps after the restored step are dropped first, so a resumed
run's log reads exactly like an uninterrupted one; so is a torn last line (a kill or a full
disk mid-write), with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from typing import Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

# The policy's token entropy: the recompute's (the whole batch, before the update) when the step
# ran one, else the update's (SFT; RL with objective.bypass or a skipped redundant recompute).
ENTROPY_KEYS = ("recompute/entropy", "update/entropy")
# What the progress shows, when present (the first key present of each).
_BAR_KEYS = {"reward": ("reward/mean",), "entropy": ENTROPY_KEYS, "loss": ("update/loss",), "time": ("time/step",)}
# Plain progress lines per run when the output is not a terminal.
PLAIN_LINES = 20


def _scalar(value) -> float | None:
    try:
        value = float(np.asarray(value))
    except (TypeError, ValueError):
        return None
    return value


def read_jsonl(path: str) -> list[dict]:
    """The rows of a metrics file. A line that is not a JSON object (a last line torn by a kill
    or a full disk) is dropped with a warning naming it, so it never blocks ``--resume``."""
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                log.warning("%s line %d is not a complete JSON row (%r...); dropped", path, number, line[:60])
    return rows


class MetricsWriteError(RuntimeError):
    """The run's metrics or TensorBoard events could not be written (a full disk, a lost mount);
    the message names ``output_dir`` and the file."""


class _TensorBoard:
    """Scalars as TensorBoard events, written and flushed in the caller's thread.

    tensorboardX's ``SummaryWriter`` hands events to a writer thread through a queue of 10; when a
    write fails (a full disk) that thread dies, and the next ``add_scalar`` waits on the full queue
    for ever: the run hung, SIGTERM and all. Written here, a failed write raises where it happens.
    On resume, a ``SessionLog.START`` at ``purge_step`` tells TensorBoard to drop the earlier
    run's events from that step on (as ``SummaryWriter(purge_step=...)`` does).
    """

    def __init__(self, folder: str, purge_step: int | None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2

        os.makedirs(folder, exist_ok=True)
        self._event_pb2 = event_pb2
        self._writer = EventsWriter(os.path.join(folder, "events"))
        if purge_step is not None:
            self._writer.write_event(event_pb2.Event(step=purge_step, session_log=event_pb2.SessionLog(
                status=event_pb2.SessionLog.START)))
        self.path = folder

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboardX.summary import scalar

        for name, value in values.items():
            self._writer.write_event(self._event_pb2.Event(wall_time=time.time(), step=step,
                                                           summary=scalar(name, value)))
        self._writer.flush()

    def text(self, step: int, tag: str, rows: Sequence[Mapping]) -> None:
        """``rows`` as one markdown table (TensorBoard's Text tab), a column per key of the first row."""
        from tensorboardX.summary import text

        columns = list(rows[0])

        def cell(value) -> str:
            return str(value).replace("|", "\\|").replace("\n", " ")

        table = "\n".join([" | ".join(columns), " | ".join("---" for _ in columns),
                           *(" | ".join(cell(row.get(c, "")) for c in columns) for row in rows)])
        self._writer.write_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=text(tag, table)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _drop_after(path: str, step: int) -> None:
    """Rewrites a JSONL log of ``{"step": ...}`` rows without those after ``step`` (a resume's), if there is one."""
    if not os.path.isfile(path):
        return
    kept = [row for row in read_jsonl(path) if row.get("step", 0) <= step]
    with open(path, "w") as f:
        for row in kept:
            f.write(json.dumps(row) + "\n")


def _shown(row: Mapping[str, float | None]) -> dict[str, str]:
    shown = {label: next((row[k] for k in keys if row.get(k) is not None), None) for label, keys in _BAR_KEYS.items()}
    return {label: f"{value:.3g}" for label, value in shown.items() if value is not None}


class _Bar:
    """A tqdm bar on a terminal; it shows the step reached (the held-out evaluation logged at step 0 is no step)."""

    def __init__(self, total: int, start: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)

    def show(self, step: int, row: Mapping[str, float | None]) -> None:
        self.bar.update(max(step - self.bar.n, 0))
        self.bar.set_postfix(_shown(row))

    def write(self, message: str) -> None:
        self.bar.write(message)

    def close(self) -> None:
        self.bar.close()


class _Lines:
    """Progress where the output is a file (CI, nohup, a scheduler's log): a bar's carriage-return
    redraws pile up there as one endless line, so one plain line every ``total / PLAIN_LINES``
    steps and at the last, with the elapsed time and an estimate of what is left."""

    def __init__(self, total: int, start: int):
        self.total, self.start, self.every = total, start, max(1, round(total / PLAIN_LINES))
        self.began = time.perf_counter()

    def show(self, step: int, row: Mapping[str, float | None]) -> None:
        if step <= self.start or (step % self.every and step != self.total):
            return
        elapsed = time.perf_counter() - self.began
        left = elapsed / (step - self.start) * (self.total - step)
        shown = "".join(f" | {label} {value}" for label, value in _shown(row).items())
        print(f"train step {step}/{self.total} ({step / max(self.total, 1):.0%}){shown} | {elapsed:.0f} s elapsed, "
              f"~{left:.0f} s left", file=sys.stderr, flush=True)

    def write(self, message: str) -> None:
        print(message, flush=True)

    def close(self) -> None:
        pass


class MetricsLogger:
    """Writes scalar metrics per step. ``log(step, metrics)``; ``close()`` at the end.

    logdir: folder for ``metrics.jsonl`` and TensorBoard events (``tb/``).
    start_step: the step training continues from (0 for a fresh run).
    progress: a bar on a terminal, plain lines otherwise (``_Lines``).
    A write that fails (a full disk) raises ``MetricsWriteError`` naming ``logdir`` and the file.
    """

    def __init__(self, logdir: str, total_steps: int, *, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = True):
        self.logdir = logdir
        self.jsonl_path = os.path.join(logdir, "metrics.jsonl")
        self._jsonl = self._tb = self._progress = None
        with self._writing(self.jsonl_path):
            os.makedirs(logdir, exist_ok=True)
            for path in (self.jsonl_path, os.path.join(logdir, "completions.jsonl")):
                _drop_after(path, start_step)
            self._jsonl = open(self.jsonl_path, "a")
        if tensorboard:
            with self._writing(os.path.join(logdir, "tb")):
                self._tb = _TensorBoard(os.path.join(logdir, "tb"), start_step + 1 if start_step else None)
        if progress:
            self._progress = (_Bar if sys.stderr.isatty() else _Lines)(total_steps, start_step)

    @contextlib.contextmanager
    def _writing(self, path: str):
        try:
            yield
        except OSError as e:
            raise MetricsWriteError(f"cannot write the run's metrics in output_dir={self.logdir} ({path}): "
                                    f"{e.strerror or e}; free space there or choose another output_dir") from None

    def log(self, step: int, metrics: Mapping[str, object]) -> dict:
        """Writes finite scalar metrics of ``step``; returns the row written."""
        row = {"step": int(step)}
        for name, value in sorted(metrics.items()):
            scalar = _scalar(value)
            if scalar is not None:
                row[name] = scalar if math.isfinite(scalar) else None
        with self._writing(self.jsonl_path):
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            with self._writing(self._tb.path):
                self._tb.scalars(int(step), {k: v for k, v in row.items() if k != "step" and v is not None})
        if self._progress is not None:
            self._progress.show(int(step), row)
        return row

    def completions(self, step: int, completions: Sequence[Mapping]) -> None:
        """A few held-out completions of ``step`` (prompt, response, reward, task): a line each in
        ``completions.jsonl`` and one TensorBoard text summary, to read what the model writes."""
        if not completions:
            return
        path = os.path.join(self.logdir, "completions.jsonl")
        with self._writing(path), open(path, "a") as f:
            for completion in completions:
                f.write(json.dumps({"step": int(step), **completion}) + "\n")
        if self._tb is not None:
            with self._writing(self._tb.path):
                self._tb.text(int(step), "heldout/completions", completions)

    def write(self, message: str) -> None:
        """A line on the terminal that does not break the progress bar."""
        if self._progress is not None:
            self._progress.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Closes the files; one that cannot be flushed any more (the disk filled) is closed without
        a second error, the first having been raised by ``log``."""
        for thing in (self._jsonl, self._tb, self._progress):
            if thing is not None:
                with contextlib.suppress(OSError):
                    thing.close()


class StageClock:
    """Wall time per stage: ``with clock("reward"): ...``; ``metrics()`` gives ``time/<stage>``,
    ``time/step`` (since the clock started) and ``time/tokens_per_second``."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str, timed: bool = True):
        if not timed:
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = time.perf_counter() - t

    def metrics(self, tokens: int) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": elapsed,
                "time/tokens_per_second": tokens / elapsed}
