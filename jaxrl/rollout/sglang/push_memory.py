"""``PushConfig.method: tensor``: the weights reach each host's servers through shared memory, no file.

The learner's parameters are read as a ``TensorStream`` (``tensors_fn``; by default
``jaxrl.models.hf.hf_tensor_stream``): with one JAX process host views of the arrays, with several
each parameter gathered to every process through JAX's collectives over the learner's mesh (NCCL
on GPUs, gloo on CPU), one at a time, so no host holds more than one gathered parameter beside
its buffers. Each process copies the tensors into its shared buffers (``SharedTensors``) in
chunks and hands each chunk to every one of its own servers with ``/update_weights_from_tensor``
(one payload per tensor-parallel rank; the server copies the data straight into its parameters)
while it copies the next; the version comes with the last chunk. The servers must be on this
process's host. The buffers keep the last push, so a server that restarts (it comes back with the
checkpoint on disk) is given it again (``reload``), and one that restarts during a push is given
the whole push again.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any, Callable, Iterable

from jaxrl.models.hf import TensorStream
from jaxrl.rollout.base import PushVerificationError
from jaxrl.rollout.sglang.client import SGLangClient
from jaxrl.rollout.sglang.fleet import Fleet

# (params) -> the checkpoint's tensors of ``params`` as a TensorStream (every process reads it whole).
TensorsFn = Callable[[Any], TensorStream]


class MemoryPush:
    """The in-memory transport of ``WeightPusher`` (module docstring)."""

    def __init__(self, fleet: Fleet, client: SGLangClient, chunk_mib: float, tensors_fn: TensorsFn):
        if not fleet.on_this_host:
            raise ValueError(f"PushConfig.method=tensor needs each process's servers on its own host, and "
                             f"{fleet.describe(0)} may not be; for servers elsewhere use method=distributed (a "
                             "process group) or disk (a checkpoint they can read)")
        from jaxrl.rollout.sglang.tensors import SharedTensors

        self.fleet = fleet
        self._client = client
        self._chunk_bytes = int(chunk_mib * 2**20)
        self._tensors_fn = tensors_fn
        self._shared = SharedTensors()
        self._ranks = fleet.config.tensor_parallel  # one payload per tensor-parallel rank
        self._last_version: str | None = None  # the version every server was given whole, for restarts
        self._restarted_in_push: set[int] | None = None  # servers that restarted during a push
        self._reload_lock = threading.Lock()
        self._reloading = threading.local()  # set while this thread reloads a restarted server

    def send(self, params, version: str) -> tuple[float, dict[str, float]]:
        """Copies the tensors into the shared buffers a chunk at a time while every server loads the
        chunks already copied, in order. Returns when the last copy ended, and push/chunks (update
        requests per server) and push/bytes (bytes handed to each server of this host). A server
        that restarts during the push (it comes back with the checkpoint on disk, and its
        weight-update session is gone) is given the whole push again once every chunk is copied,
        in new shared files, whether or not its own requests failed. Any other failure stops the
        run, leaving a server with some new tensors under its old version; the next push replaces
        them all."""
        self._last_version = None  # the buffers are about to hold weights no server has verified
        channels = [queue.SimpleQueue() for _ in range(self.fleet.num_servers)]  # each server's chunks
        chunks, failed = 0, {}
        self._restarted_in_push = set()
        try:
            with concurrent.futures.ThreadPoolExecutor(self.fleet.num_servers) as pool:
                loads = [pool.submit(self._load, i, iter(channel.get, None), version)
                         for i, channel in enumerate(channels)]
                try:
                    stream = self._tensors_fn(params)
                    for chunk in self._shared.chunks(stream, self._chunk_bytes):
                        chunks += 1
                        for channel in channels:
                            channel.put(chunk)  # names: each server's load makes its own payloads
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
                self._load(i, [(self._shared.renew(), True)], version)
        finally:
            self._restarted_in_push = None
        # Every server holds this version now: one that dies from here on, during the push's own
        # verification included, is given it again (``reload``).
        self._last_version = version
        return copied, {"push/chunks": chunks, "push/bytes": self._shared.nbytes}

    def verified(self, version: str) -> None:
        """Nothing more to keep: the buffers are the record (``send``)."""

    def reload(self, index: int) -> None:
        """After server ``index`` restarted: it came back with the last checkpoint on disk, so it is
        given the last pushed tensors again, in new shared files (``SharedTensors.renew``), and
        checked for their version. Called from the client's retry path, in one of its threads; a
        restart during the reload is left to this reload."""
        if self._restarted_in_push is not None:  # a push is under way: it gives this server all of it again
            self._restarted_in_push.add(index)
            return
        version = self._last_version
        if version is None or getattr(self._reloading, "active", False):
            return
        with self._reload_lock:
            self._reloading.active = True
            try:
                self._load(index, [(self._shared.renew(), True)], version)
                info = self._client.request(index, "GET", "/model_info", None,
                                            f"version check after reloading {version!r}")
            finally:
                self._reloading.active = False
        if info.get("weight_version") != version:
            raise PushVerificationError(f"{self.fleet.describe(index)} restarted and was given the tensors of version "
                                        f"{version!r} again, but reports {info.get('weight_version')!r}")

    def close(self) -> None:
        self._shared.close()

    def _load(self, index: int, chunks: Iterable[tuple[list[str], bool]], version: str) -> None:
        """One server's ``/update_weights_from_tensor`` of each ``(names, is_last)`` chunk inside
        the weight-update session SGLang requires (``/begin_weight_update`` .. ``/end_weight_update``,
        closed even on failure), a payload of its own for each of its tensor-parallel ranks
        (``SharedTensors.payload``); the last chunk sets ``version`` and flushes the server's cache."""
        name = f"in-memory weight push of version {version!r}"
        self._client.request(index, "POST", "/begin_weight_update", {}, name)
        try:
            for names, last in chunks:
                result = self._client.request(index, "POST", "/update_weights_from_tensor", {
                    "serialized_named_tensors": [self._shared.payload(names) for _ in range(self._ranks)],
                    "weight_version": version if last else None, "flush_cache": last}, name)
                if not result.get("success", False):
                    raise PushVerificationError(
                        f"{self.fleet.describe(index)}: {name} failed: {result.get('message')!r}; check that the "
                        "tensors have the served architecture's names and shapes, or use PushConfig.method=disk")
        finally:
            self._client.request(index, "POST", "/end_weight_update", {}, name)

