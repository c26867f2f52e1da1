"""Orbax checkpoints of a training run: arrays (model, optimizer, step) plus a JSON side record.

What is saved under ``<dir>/<step>/``:
- ``state``: the train-step state pytree (``params``, ``opt_state``, ``step``), written
  by TensorStore through Orbax's StandardSave;
- ``meta``: JSON with the RNG key data, the data iterator state, and anything else
  the loop needs to continue bit for bit (e.g. the engine's weight version);
- optional further named pytrees (``items``), e.g. ``critic``: the critic's train-step state
  of PPO with GAE, present only in runs that have one (so checkpoints of runs without it
  keep their layout). A run that needs an item its checkpoint lacks is refused with
  ``CheckpointMismatchError`` naming it (never mistaken for damage).

Saves are asynchronous (Orbax copies device arrays to host, then writes in the
background; ``wait()`` blocks) and atomic (Orbax writes into a temporary folder
and renames it when complete, so a crash mid-save leaves the previous step as the
latest usable checkpoint). Only the last ``keep`` are kept.
Restoring takes a target state: its shapes, dtypes and *shardings* decide where the
arrays land, so a checkpoint written on one mesh restores onto another.

Faults: a latest checkpoint that cannot be read (a missing or truncated file, bad metadata) is
reported with its path and the cause, moved aside as ``<step>.damaged`` (kept for a look, out
of the way of the step's next save), and the newest intact one is restored instead. A save
that fails, in the foreground or in the background, raises ``CheckpointSaveError`` naming the
folder and the cause at the first check after it failed (the loop checks after every step).
Orbax's own reports of that failure (each background thread logs its traceback, and asyncio the
futures left behind: hundreds of lines for one full disk) are kept off the terminal, at DEBUG
under this module's logger: the one line is the report (``_OrbaxFailureReports``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions, storage errors)."""


class CheckpointMismatchError(ValueError):
    """An intact checkpoint lacks an item the run needs (it was written by a different kind of run)."""


def _cause(error: BaseException) -> str:
    """The innermost exception's one-line description (Orbax wraps the real cause)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


class _OrbaxFailureReports(logging.Filter):
    """Holds back Orbax's reports of a failed save, once this process has a Checkpointer: ERROR
    records that Orbax's code logs (on the ``absl`` logger: one traceback per background thread)
    or that asyncio logs about Orbax's futures and tasks left unretrieved, and the teardown noise
    of those futures ("Event loop is closed" raised in tensorstore's callbacks; once a failure was
    seen, "coroutine was never awaited" warnings). Each is kept at DEBUG under this module's logger.

    ``failed`` is also the signal that a background save has failed: Orbax has no way to ask
    short of waiting for the save, so the step boundary after it waits (briefly: the save is
    failing) and raises, instead of training on until the save winds down. It is cleared when a
    save starts. The filter stays for the life of the process: asyncio reports a future when it
    is collected, which can be after the run has closed its checkpoints."""

    LOGGERS = ("absl", "asyncio")
    _ORBAX = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"
    # An error raised inside tensorstore has no Orbax frame in its traceback, only the folder Orbax
    # writes into ("ck/2.orbax-checkpoint-tmp/state...": a full disk's ENOSPC, found in a CI run).
    _ORBAX_FOLDER = ".orbax-checkpoint-tmp"

    def __init__(self):
        super().__init__()
        self.installed = False
        self.failed: str | None = None

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        previous = sys.unraisablehook

        def hook(unraisable):  # tensorstore's callbacks into the loop of a save that failed
            if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
                log.debug("held back: %r in %r", unraisable.exc_value, unraisable.object)
                return
            previous(unraisable)

        sys.unraisablehook = hook

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        where = record.pathname if record.name == "absl" else text
        if self._ORBAX not in where and self._ORBAX_FOLDER not in where:
            return True
        if self.failed is None:
            self.failed = text.splitlines()[0]
            # The failed save's coroutines are never awaited; Python warns of each as they are collected.
            warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)
        log.debug("held back from %s: %s", record.name, text)
        return False


_FAILURE_REPORTS = _OrbaxFailureReports()


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """directory: where checkpoints go ("" disables them); every: save each N steps (and at the end);
    keep: how many to keep; async_save: write in the background; export_hf: a folder for a final
    Hugging Face export ("" = none); stop_timeout_s: after SIGTERM or SIGINT the run finishes its
    step and saves; one still running this many seconds later is stuck (a hung server, a full
    disk) and exits without saving, naming where it was (``jaxrl.trainer.lifecycle.StopSignals``)."""

    directory: str = ""
    every: int = 50
    keep: int = 2
    async_save: bool = True
    export_hf: str = ""
    stop_timeout_s: float = 600.0

    def __post_init__(self):
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint.every ({self.every}) and checkpoint.keep ({self.keep}) must be >= 1")
        if self.stop_timeout_s <= 0:
            raise ValueError(f"checkpoint.stop_timeout_s must be > 0 seconds, got {self.stop_timeout_s}")


def _abstract(tree):
    """ShapeDtypeStructs carrying each array's sharding: the restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


class Checkpointer:
    """Save/restore a run's state and JSON metadata with an Orbax CheckpointManager."""

    def __init__(self, config: CheckpointConfig):
        if not config.directory:
            raise ValueError("Checkpointer needs checkpoint.directory; set it or disable checkpoints")
        self.config = config
        self._pending: int | None = None  # the step of a save started and not yet waited for
        # A URL (gs://bucket/run) goes to Orbax as given; abspath would turn it into a local "gs:/" folder.
        self.directory = config.directory if "://" in config.directory else os.path.abspath(config.directory)
        _FAILURE_REPORTS.install()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.keep,
                enable_async_checkpointing=config.async_save,
                cleanup_tmp_directories=True,
            ),
        )

    def should_save(self, step: int) -> bool:
        return step % self.config.every == 0

    def save(self, step: int, state: Any, meta: dict, items: dict[str, Any] | None = None) -> None:
        """Starts saving ``state`` (a pytree of jax arrays), ``meta`` (JSON-able) and the named
        pytrees ``items`` as ``step``.

        A previous background save is waited for first (Orbax would block on it anyway), so its
        failure is reported under its own step, not under this one."""
        if self._pending is not None:
            self.wait()
        self._pending = step
        _FAILURE_REPORTS.failed = None
        extra = {name: ocp.args.StandardSave(tree) for name, tree in (items or {}).items()}
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta), **extra),
                force=True,
            )
        except Exception as e:
            raise self._save_error(e, step) from e

    def check_for_errors(self) -> None:
        """Raises CheckpointSaveError when a background save has failed since the last check.

        Orbax keeps a failure of its finalising thread until the next save or wait, so a save
        that is no longer in progress, or one of whose threads has reported a failure, is waited
        for here (at little cost: it is done, or failing)."""
        if self._pending is None:
            return
        if _FAILURE_REPORTS.failed is not None or not self._manager.is_saving_in_progress():
            self.wait()

    def _save_error(self, error: BaseException, step: int | None = None) -> CheckpointSaveError:
        which = f"checkpoint of step {step}" if step is not None else "a background checkpoint save"
        return CheckpointSaveError(f"writing {which} to {self.directory} failed: {_cause(error)}; "
                                   f"free space there or point checkpoint.directory elsewhere, then --resume")

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) of ``step`` (default: the newest intact one), placed like ``target_state``
        (shardings included). Without ``step``, damaged checkpoints are reported, moved aside
        and skipped; FileNotFoundError when none is left."""
        state, meta, _ = self.restore_with_items(target_state, {}, step)
        return state, meta

    def restore_with_items(self, target_state: Any, items: dict[str, Any],
                           step: int | None = None) -> tuple[Any, dict, dict[str, Any]]:
        """(state, meta, items) as :meth:`restore`, with the named pytrees ``items`` (name -> target,
        placed like it) too. A checkpoint without one of them raises CheckpointMismatchError."""
        if step is not None:
            return self._restore_step(target_state, step, items)
        damaged = []
        for candidate in sorted(self.all_steps(), reverse=True):
            try:
                restored = self._restore_step(target_state, candidate, items)
            except CheckpointMismatchError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable.
                damaged.append(candidate)
                log.warning("checkpoint %s is damaged (%s); trying the previous one",
                            self._step_path(candidate), _cause(e))
                continue
            if damaged:
                self._set_aside(damaged)
                log.warning("resuming from step %d, the newest intact checkpoint (damaged: %s)", candidate,
                            ", ".join(str(s) for s in damaged))
            return restored
        raise FileNotFoundError(
            f"no complete checkpoint in {self.directory}"
            + (f" (damaged: {', '.join(map(str, damaged))})" if damaged else "")
            + "; run without --resume to start fresh")

    def _restore_step(self, target_state: Any, step: int, items: dict[str, Any]) -> tuple[Any, dict, dict]:
        for name in items:  # a checkpoint with its state but without the item is intact, just another run's
            if not self._has_item(step, name) and self._has_item(step, "state"):
                raise CheckpointMismatchError(
                    f"checkpoint {self._step_path(step)} holds no {name!r}, which this run needs: it was written "
                    f"by a run without one")
        extra = {name: ocp.args.StandardRestore(_abstract(target)) for name, target in items.items()}
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(target_state)), meta=ocp.args.JsonRestore(), **extra
            ),
        )
        meta = restored["meta"]
        if not isinstance(meta, dict) or "step" not in meta:
            raise ValueError(f"metadata {meta!r} is not a run's record (no 'step')")
        return restored["state"], dict(meta), {name: restored[name] for name in items}

    def _has_item(self, step: int, name: str) -> bool:
        from etils import epath

        return (epath.Path(self._step_path(step)) / name).exists()

    def _step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _set_aside(self, steps: list[int]) -> None:
        """Renames damaged step folders to ``<step>.damaged`` so the run can save those steps again."""
        if jax.process_index() == 0:
            from etils import epath

            for step in steps:
                path = epath.Path(self._step_path(step))
                target = epath.Path(f"{path}.damaged")
                if target.exists():
                    target.rmtree()
                path.rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxrl checkpoint set aside")
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until the background save is written; CheckpointSaveError if it failed."""
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            raise self._save_error(e, step) from e

    def close(self) -> None:
        """Waits for the last save and releases Orbax. A failure here is logged, not raised: the
        loop's own ``wait()`` has surfaced it, and raising again would hide the first report."""
        try:
            self._manager.wait_until_finished()
            self._manager.close()
        except Exception as e:  # noqa: BLE001
            log.error("closing the checkpoints in %s: %s", self.directory, _cause(e))
