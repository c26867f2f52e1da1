"""Orbax checkpoints of a training run: arrays (model, optimizer, step) plus a JSON side record.

What is saved under ``<dir>/<step>/``:
- ``state``: the train-step state pytree (``params``, ``opt_state``, ``step``), written
  by TensorStore through Orbax's StandardSave;
- ``meta``: JSON with the RNG key data, the data iterator state, and anything else
  the loop needs to continue bit for bit (e.g. the engine's weight version).

Saves are asynchronous (Orbax copies device arrays to host, then writes in the
background; ``wait()`` blocks) and atomic (Orbax writes into a temporary folder
and renames it when complete, so a crash mid-save leaves the previous step as the
latest usable checkpoint). Only the last ``keep`` are kept.
Restoring takes a target state: its shapes, dtypes and *shardings* decide where the
arrays land, so a checkpoint written on one mesh restores onto another.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """directory: where checkpoints go ("" disables them); every: save each N steps (and at the end);
    keep: how many to keep; async_save: write in the background; export_hf: a folder for a final
    Hugging Face export ("" = none)."""

    directory: str = ""
    every: int = 50
    keep: int = 2
    async_save: bool = True
    export_hf: str = ""

    def __post_init__(self):
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint.every ({self.every}) and checkpoint.keep ({self.keep}) must be >= 1")


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
        # A URL (gs://bucket/run) goes to Orbax as given; abspath would turn it into a local "gs:/" folder.
        self.directory = config.directory if "://" in config.directory else os.path.abspath(config.directory)
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

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts saving ``state`` (a pytree of jax arrays) and ``meta`` (JSON-able) as ``step``."""
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) of ``step`` (default: latest), placed like ``target_state`` (shardings included)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(
                f"no complete checkpoint in {self.directory}; run without --resume to start fresh"
            )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(target_state)), meta=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], dict(restored["meta"])

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
