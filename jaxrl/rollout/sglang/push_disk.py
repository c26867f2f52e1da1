"""``PushConfig.method: disk``: each push a Hugging Face checkpoint the servers load from a folder.

The learner's parameters are exported into a temporary folder and renamed into place (a crash
never leaves a half-written checkpoint a server could load), then every server loads it with
``/update_weights_from_disk`` and the new ``weight_version``. Once the push is verified the fleet
records it once every server has loaded it, so a server that restarts from then on (during the
push's verification too) comes back with it; once verified, all but the newest
``keep_checkpoints`` folders are deleted. With several JAX processes the export is written once
(process 0) into ``checkpoint_dir``, which every host must see (a shared file system), and each
process loads it on its own servers. Only where a user asks for it: the in-memory push
(push_memory.py) writes no file.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time
import uuid
from typing import Any, Callable

import jax

from jaxrl import distributed
from jaxrl.rollout.base import PushVerificationError
from jaxrl.rollout.sglang.client import SGLangClient
from jaxrl.rollout.sglang.fleet import Fleet

# (params, folder) -> None: writes config.json + safetensors for ``params`` into folder.
ExportFn = Callable[[Any, str], None]


class PushedCheckpoints:
    """The folder pushed checkpoints live in: each written whole or not at all, the newest
    ``keep`` kept so that a restarted server can reload the last push."""

    def __init__(self, checkpoint_dir: str, keep: int, export_fn: ExportFn):
        self.checkpoint_dir = checkpoint_dir
        self.keep = keep
        self._export_fn = export_fn

    def write(self, params, version: str) -> pathlib.Path:
        """Exports ``params`` as ``weights-<version>``; returns that folder."""
        root = pathlib.Path(self.checkpoint_dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"weights-{_safe_name(version)}"
        if final.exists():
            raise ValueError(f"SGLangEngine.update_weights: {final} exists already; version "
                             f"{version!r} was pushed before (versions must be new)")
        if jax.process_count() > 1:
            return self._write_shared(params, final, version)
        temporary = root / f".partial-{_safe_name(version)}-{uuid.uuid4().hex[:8]}"
        try:
            self._export_fn(params, str(temporary))
            _check_exported(temporary)
            os.rename(temporary, final)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
        return final

    def _write_shared(self, params, final: pathlib.Path, version: str) -> pathlib.Path:
        """Several processes: every one calls ``export_fn`` on the same folder (the default export is a
        collective in which process 0 writes), process 0 renames it into place, and every process
        then loads it on its own servers, so ``checkpoint_dir`` must be storage all hosts see."""
        from jax.experimental import multihost_utils  # noqa: PLC0415

        temporary = final.parent / f".partial-{_safe_name(version)}"  # the same name in every process
        if distributed.is_main_process():
            shutil.rmtree(temporary, ignore_errors=True)
        multihost_utils.sync_global_devices(f"jaxrl sglang push {version} begins")
        try:
            self._export_fn(params, str(temporary))
            multihost_utils.sync_global_devices(f"jaxrl sglang push {version} exported")
            if distributed.is_main_process():
                _check_exported(temporary)
                os.rename(temporary, final)
        finally:
            if distributed.is_main_process():
                shutil.rmtree(temporary, ignore_errors=True)
        multihost_utils.sync_global_devices(f"jaxrl sglang push {version} in place")
        if not (final / "config.json").is_file():
            raise FileNotFoundError(
                f"process {jax.process_index()} cannot see {final / 'config.json'}, which process 0 "
                "wrote; with several processes PushConfig.checkpoint_dir must be on storage every "
                "host sees (a shared file system), or use PushConfig.method=tensor (no file at all)")
        return final

    def prune(self, newest: pathlib.Path) -> None:
        """Deletes all but the ``keep`` newest pushed checkpoints, never ``newest``."""
        if not distributed.is_main_process():
            return  # the pushed folders are shared: process 0 prunes them
        pushed = sorted(newest.parent.glob("weights-*"), key=lambda p: p.stat().st_mtime)
        for old in pushed[: max(len(pushed) - self.keep, 0)]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)


class DiskPush:
    """The disk transport of ``WeightPusher`` (module docstring)."""

    def __init__(self, fleet: Fleet, client: SGLangClient, checkpoint_dir: str, keep: int, export_fn: ExportFn):
        self.fleet = fleet
        self._client = client
        self._checkpoints = PushedCheckpoints(checkpoint_dir, keep, export_fn)
        self._path: pathlib.Path | None = None

    def send(self, params, version: str) -> tuple[float, dict[str, float]]:
        """Writes the checkpoint and loads it on every server; returns when the write ended."""
        self._path = self._checkpoints.write(params, version)
        exported = time.perf_counter()
        payload = {"model_path": str(self._path), "weight_version": version, "flush_cache": True}
        name = f"weight push of version {version!r} from {self._path}"
        calls = [(i, "POST", "/update_weights_from_disk", payload, name) for i in range(self.fleet.num_servers)]
        for i, result in enumerate(self._client.map(calls)):
            if not result.get("success", False):
                raise PushVerificationError(
                    f"{self.fleet.describe(i)}: {name} failed: {result.get('message')!r}; check "
                    "that the checkpoint has the served architecture and parameter names")
        # Every server loaded it: one that dies from here on, during the push's own verification
        # included, comes back with it.
        self.fleet.record_weights(str(self._path), version)
        return exported, {}

    def verified(self, version: str) -> None:
        """The older checkpoints go (never the one a restarted server reloads)."""
        self._checkpoints.prune(newest=self._path)

    def reload(self, index: int) -> None:
        """Nothing to do: the fleet restarts a server from the last recorded checkpoint."""

    def close(self) -> None:
        """Nothing held: the pushed folders stay for the next run's servers."""


def _check_exported(folder: pathlib.Path) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError(f"export_fn wrote no config.json into {folder}; it must write a "
                         "complete Hugging Face checkpoint (config.json + *.safetensors)")


def _safe_name(version: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in version)
