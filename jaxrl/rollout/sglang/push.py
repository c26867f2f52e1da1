"""The SGLang weight push and its verification (docs/rollouts.md#weight-push-and-its-verification).

``PushConfig.method: disk`` (the default): export the learner's parameters as a Hugging Face
checkpoint into a temporary folder, rename it into place (a crash never leaves a
half-written checkpoint a server could load), ``/update_weights_from_disk`` on every server
with the new ``weight_version``. ``method: tensor``, for servers on the learner's host and
one JAX process: the same named tensors go to ``/update_weights_from_tensor`` through shared
memory (``jaxrl.rollout.sglang.tensors``), no file written, in chunks (each server loads one
while the next is copied; the version comes with the last); the pusher keeps them, so a
server that restarts is given them again (``reload``), and one that restarts during a push is
given the whole push again. Then, either way, every server scores a
fixed probe sequence; its answer must name the new version and match the learner's own
recompute of the probe. A mismatch is a ``PushVerificationError``.

With several JAX processes (jaxrl.distributed) a push is a collective: the export
is written once to ``PushConfig.checkpoint_dir`` (which all hosts must see) and
every process loads it on, and verifies, its own servers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import queue
import shutil
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable, Iterable, Literal

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.rollout.base import PushVerificationError
from jaxrl.rollout.sglang.client import SGLangClient
from jaxrl.rollout.sglang.fleet import Fleet

# (params, folder) -> None: writes config.json + safetensors for ``params`` into folder.
ExportFn = Callable[[Any, str], None]
# (params, token_ids [L] int) -> [L - 1] float: log p(token_{t+1} | tokens_{<=t}), raw logits, T = 1.
RecomputeFn = Callable[[Any, np.ndarray], np.ndarray]
# (params) -> {HF tensor name: host array}: what a checkpoint of ``params`` holds (method: tensor);
# views of the learner's arrays will do: they are copied into shared memory before the push goes on.
TensorsFn = Callable[[Any], dict[str, np.ndarray]]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def export_decoder(model, path: str) -> None:
    """Default ``ExportFn``: ``jaxrl.models.save_hf_checkpoint`` of the learner's ``Decoder``."""
    from jaxrl.models import save_hf_checkpoint

    save_hf_checkpoint(model, path)


def tensors_decoder(model) -> dict[str, np.ndarray]:
    """Default ``TensorsFn``: ``jaxrl.models.hf.hf_tensor_views`` of the learner's ``Decoder`` (host
    views of its parameters in HF's layout, each copied once, into its shared buffer)."""
    from jaxrl.models.hf import hf_tensor_views

    return hf_tensor_views(model)


def recompute_decoder(model, token_ids: np.ndarray) -> np.ndarray:
    """Default ``RecomputeFn``: the learner's one scoring path (``jaxrl.models.scoring``, which the
    trainer's ``old_logp`` and the alignment checker use too) on one sequence; [L - 1] float32."""
    from jaxrl.models.scoring import sequence_logprobs

    ids = np.asarray(token_ids, np.int32)[None]
    return sequence_logprobs(model, ids, np.asarray([ids.shape[1]], np.int32))[0, 1:]


@dataclasses.dataclass(frozen=True)
class PushConfig:
    """method: "disk" (a checkpoint per push, any host) or "tensor" (shared memory, servers on
    this host, one JAX process; docs/rollouts.md#weight-push-and-its-verification);
    checkpoint_dir: where pushed checkpoints are written (``weights-<version>``; method disk);
    keep_checkpoints: newest pushed checkpoints kept on disk (>= 1: a restarted server reloads the newest);
    probe_ids: the fixed token sequence scored after every push (>= 2 tokens);
    probe_atol: largest allowed |engine logprob - learner logprob| on the probe;
    chunk_mib: method tensor: the tensors go over in chunks of at least this many MiB (> 0), so
      the servers load one chunk while the learner copies the next."""

    method: Literal["disk", "tensor"] = "disk"
    checkpoint_dir: str = "runs/sglang/checkpoints"
    keep_checkpoints: int = 2
    probe_ids: tuple[int, ...] = (1, 7, 23, 3, 29, 5, 12, 8, 30, 2, 31, 17)
    probe_atol: float = 1e-5
    chunk_mib: float = 128.0

    def __post_init__(self):
        object.__setattr__(self, "probe_ids", tuple(int(t) for t in self.probe_ids))
        if self.method not in ("disk", "tensor"):
            raise ValueError(f"PushConfig.method: got {self.method!r}, expected 'disk' or 'tensor'")
        if self.keep_checkpoints < 1:
            raise ValueError(f"PushConfig.keep_checkpoints: got {self.keep_checkpoints}, expected >= 1")
        if len(self.probe_ids) < 2 or min(self.probe_ids) < 0:
            raise ValueError(f"PushConfig.probe_ids: got {self.probe_ids}, expected >= 2 token ids >= 0")
        if not self.probe_atol > 0:
            raise ValueError(f"PushConfig.probe_atol: got {self.probe_atol}, expected > 0")
        if not self.chunk_mib > 0:
            raise ValueError(f"PushConfig.chunk_mib: got {self.chunk_mib}, expected > 0 (MiB per in-memory chunk)")


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
                "host sees (a shared file system)")
        return final

    def prune(self, newest: pathlib.Path) -> None:
        """Deletes all but the ``keep`` newest pushed checkpoints, never ``newest``."""
        if not distributed.is_main_process():
            return  # the pushed folders are shared: process 0 prunes them
        pushed = sorted(newest.parent.glob("weights-*"), key=lambda p: p.stat().st_mtime)
        for old in pushed[: max(len(pushed) - self.keep, 0)]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)


class WeightPusher:
    """Pushes the learner's parameters to every server of ``fleet`` (through ``client``) and
    verifies the push took effect before the fleet is told to keep those weights.

    export_fn / recompute_fn: how to write the learner's parameters as an HF checkpoint
      and how the learner scores a sequence. The defaults take a ``jaxrl.models.Decoder``.
    """

    def __init__(self, fleet: Fleet, client: SGLangClient, config: PushConfig = PushConfig(),
                 export_fn: ExportFn = export_decoder, recompute_fn: RecomputeFn = recompute_decoder,
                 tensors_fn: TensorsFn = tensors_decoder):
        self.fleet = fleet
        self.config = config
        self._client = client
        self._checkpoints = PushedCheckpoints(config.checkpoint_dir, config.keep_checkpoints, export_fn)
        self._recompute_fn = recompute_fn
        self._tensors_fn = tensors_fn
        self._last_version: str | None = None  # method tensor: the version in the buffers, for restarts
        self._restarted_in_push: set[int] | None = None  # method tensor: servers that restarted during a push
        self._reload_lock = threading.Lock()
        self._reloading = threading.local()  # set while this thread reloads a restarted server
        if config.method == "tensor":
            self._check_tensor_method()
            from jaxrl.rollout.sglang.tensors import SharedTensors

            self._shared = SharedTensors()

    def push(self, params, version: str) -> dict[str, float]:
        """Pushes ``params`` as ``version`` and verifies it; returns timing metrics.

        Metrics (seconds unless named otherwise): push/export_s (checkpoint
        write; method tensor: the copies into shared memory, which the servers' loads overlap),
        push/load_s (servers loading it, after the export), push/verify_s (version and probe
        checks), push/total_s, push/probe_max_abs_diff (nats); method tensor: push/chunks
        (update requests per server).
        """
        start = time.perf_counter()
        extra = {}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            expected = self._probe_recompute(params, pool)
            if self.config.method == "tensor":
                self._last_version = None  # the buffers are about to hold weights no server has verified
                exported, extra["push/chunks"] = self._push_tensors(params, version)
            else:
                path = self._checkpoints.write(params, version)
                exported = time.perf_counter()
                self._load_everywhere(path, version)
            loaded = time.perf_counter()
            diff = self._verify(version, expected)
        verified = time.perf_counter()
        if self.config.method == "tensor":
            self._last_version = version
        else:
            self.fleet.record_weights(str(path), version)
            self._checkpoints.prune(newest=path)
        return {
            "push/export_s": exported - start,
            "push/load_s": loaded - exported,
            "push/verify_s": verified - loaded,
            "push/total_s": verified - start,
            "push/probe_max_abs_diff": diff,
            **extra,
        }

    def _load_everywhere(self, path: pathlib.Path, version: str) -> None:
        payload = {"model_path": str(path), "weight_version": version, "flush_cache": True}
        name = f"weight push of version {version!r} from {path}"
        calls = [(i, "POST", "/update_weights_from_disk", payload, name)
                 for i in range(self.fleet.num_servers)]
        for i, result in enumerate(self._client.map(calls)):
            if not result.get("success", False):
                raise PushVerificationError(
                    f"{self.fleet.describe(i)}: {name} failed: {result.get('message')!r}; check "
                    "that the checkpoint has the served architecture and parameter names")

    def reload(self, index: int) -> None:
        """After server ``index`` restarted: with method tensor it came back with the last
        checkpoint on disk, so it is given the last pushed tensors again, in new shared files
        (``SharedTensors.renew``), and checked for their version. Called from the client's retry
        path, in one of its threads; a restart during the reload is left to this reload."""
        if self._restarted_in_push is not None:  # a push is under way: it gives this server all of it again
            self._restarted_in_push.add(index)
            return
        version = self._last_version
        if version is None or getattr(self._reloading, "active", False):
            return
        with self._reload_lock:
            self._reloading.active = True
            try:
                self._load_tensors(index, [(self._shared.renew(), True)], version)
                info = self._client.request(index, "GET", "/model_info", None,
                                            f"version check after reloading {version!r}")
            finally:
                self._reloading.active = False
        if info.get("weight_version") != version:
            raise PushVerificationError(f"{self.fleet.describe(index)} restarted and was given the tensors of version "
                                        f"{version!r} again, but reports {info.get('weight_version')!r}")

    def _check_tensor_method(self) -> None:
        if jax.process_count() > 1:
            raise ValueError("PushConfig.method=tensor runs with one JAX process (the tensors are handed over on "
                             "this host); use method=disk with several processes")
        remote = [url for url in self.fleet.urls if urllib.parse.urlsplit(url).hostname not in LOCAL_HOSTS]
        if remote:
            raise ValueError(f"PushConfig.method=tensor needs the servers on this host, but {remote[0]} is not a "
                             "local address; use method=disk (a checkpoint the servers can read) for remote servers")

    def _call_everywhere(self, call: Callable[[int], Any]) -> list[Any]:
        """``call(i)`` for every server at once (each its own HTTP calls); their results in server
        order; the first failure is raised."""
        with concurrent.futures.ThreadPoolExecutor(self.fleet.num_servers) as pool:
            return [future.result() for future in [pool.submit(call, i) for i in range(self.fleet.num_servers)]]

    def _push_tensors(self, params, version: str) -> tuple[float, int]:
        """Method tensor: copies the tensors into the shared buffers a chunk at a time while every
        server loads the chunks already copied, in order. Returns when the last copy ended and
        the number of chunks. A server that restarts during the push (it comes back with the
        checkpoint on disk, and its weight-update session is gone) is given the whole push again
        once every chunk is copied, in new shared files, whether or not its own requests failed.
        Any other failure stops the run, leaving a server with some new tensors under its old
        version; the next push replaces them all."""
        channels = [queue.SimpleQueue() for _ in range(self.fleet.num_servers)]
        chunks, failed = 0, {}
        self._restarted_in_push = set()
        try:
            with concurrent.futures.ThreadPoolExecutor(self.fleet.num_servers) as pool:
                loads = [pool.submit(self._load_tensors, i, iter(channel.get, None), version)
                         for i, channel in enumerate(channels)]
                try:
                    for chunk in self._shared.chunks(self._tensors_fn(params), int(self.config.chunk_mib * 2**20)):
                        chunks += 1
                        for channel in channels:
                            channel.put(chunk)
                finally:
                    for channel in channels:
                        channel.put(None)
                copied = time.perf_counter()
                for i, load in enumerate(loads):
                    if load.exception() is not None:
                        failed[i] = load.exception()
            restarted, self._restarted_in_push = self._restarted_in_push, None
            for i, error in failed.items():
                if i not in restarted:
                    raise error
            for i in sorted(restarted):
                self._load_tensors(i, [(self._shared.renew(), True)], version)
        finally:
            self._restarted_in_push = None
        return copied, chunks

    def _load_tensors(self, index: int, chunks: Iterable[tuple[str, bool]], version: str) -> None:
        """One server's ``/update_weights_from_tensor`` of each ``(payload, is_last)`` chunk
        (``SharedTensors``) inside the weight-update session SGLang requires
        (``/begin_weight_update`` .. ``/end_weight_update``, closed even on failure); the last
        chunk sets ``version`` and flushes the server's cache."""
        name = f"in-memory weight push of version {version!r}"
        self._client.request(index, "POST", "/begin_weight_update", {}, name)
        try:
            for payload, last in chunks:
                result = self._client.request(index, "POST", "/update_weights_from_tensor", {
                    "serialized_named_tensors": [payload], "weight_version": version if last else None,
                    "flush_cache": last}, name)
                if not result.get("success", False):
                    raise PushVerificationError(
                        f"{self.fleet.describe(index)}: {name} failed: {result.get('message')!r}; check that the "
                        "tensors have the served architecture's names and shapes, or use PushConfig.method=disk")
        finally:
            self._client.request(index, "POST", "/end_weight_update", {}, name)

    def _probe_recompute(self, params, pool: concurrent.futures.Executor) -> Callable[[], np.ndarray]:
        """The learner's probe logprobs, to be read once the servers have loaded: with one JAX
        process computed in ``pool`` meanwhile (it needs only ``params``; about 30 ms of a ~100M
        model's push here); with several in place, first, since the recompute is a collective every
        process must enter in the same order."""
        if jax.process_count() > 1:
            expected = self._expected_probe(params)
            return lambda: expected
        return pool.submit(self._expected_probe, params).result

    def _expected_probe(self, params) -> np.ndarray:
        probe = np.asarray(self.config.probe_ids, np.int32)
        expected = np.asarray(self._recompute_fn(params, probe), np.float64)
        if expected.shape != (len(probe) - 1,):
            raise ValueError(f"recompute_fn returned shape {expected.shape}; expected "
                             f"({len(probe) - 1},): log p(token t+1 | tokens <= t) of the probe")
        return expected

    def _verify(self, version: str, expected: Callable[[], np.ndarray]) -> float:
        """Every server scores the probe; the answer must carry ``version`` and logprobs within
        ``probe_atol`` of the learner's ``expected()``. Returns the largest difference (nats)."""
        probe = list(self.config.probe_ids)
        answers = self._call_everywhere(lambda i: self._client.score_request(i, probe))
        expected = expected()
        worst = 0.0
        for i, meta in enumerate(answers):
            if meta.get("weight_version") != version:
                raise PushVerificationError(
                    f"{self.fleet.describe(i)} reports weight_version {meta.get('weight_version')!r} after the "
                    f"push of {version!r}; the update did not take effect: check the server log and that "
                    "/update_weights_from_disk accepts weight_version (SGLang >= 0.5.23)")
            got = self._client.scored_logprobs(i, probe, meta)
            diff = float(np.max(np.abs(got.astype(np.float64) - expected)))
            worst = max(worst, diff)
            if not diff <= self.config.probe_atol:
                raise PushVerificationError(
                    f"{self.fleet.describe(i)}: after pushing version {version!r}, the probe's "
                    f"logprobs differ from the learner's recompute by up to {diff:.3g} nats "
                    f"(PushConfig.probe_atol={self.config.probe_atol:g}); the server is not "
                    "serving the learner's weights: check the export (parameter names, dtype, "
                    "tied embeddings) and the server's --dtype")
        return worst


def _check_exported(folder: pathlib.Path) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError(f"export_fn wrote no config.json into {folder}; it must write a "
                         "complete Hugging Face checkpoint (config.json + *.safetensors)")


def _safe_name(version: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in version)
