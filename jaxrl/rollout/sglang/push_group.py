"""``PushConfig.method: distributed``: the weights broadcast over a torch process group to servers elsewhere.

For inference fleets jaxrl did not start (``rollout.sglang.external``), which share neither a disk
nor a host with the learner. At the first push the learner (JAX process 0, rank 0) and every rank
of every server form one ``torch.distributed`` group through SGLang's ``/init_weights_update_group``
(server i's ranks from ``rank_offset`` = 1 + the ranks before it; gloo where the servers run on
CPU, NCCL on GPUs, ``PushConfig.group_backend``), meeting at ``group_address:group_port``, which
every server must reach. Each push then reads the tensors as a ``TensorStream`` (every JAX process:
the gathers are collectives) and process 0 sends them chunk by chunk: for each chunk every server
gets ``/update_weights_from_distributed`` with its names, dtypes and shapes while the learner
broadcasts the tensors in that order (the version comes with the last chunk), inside the weight-update
session SGLang requires; the other processes wait for its last broadcast before they verify.
Nothing is written to disk; the learner's side needs torch (CPU torch for gloo; a CUDA build, on
the learner's GPU, for NCCL).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import time
import uuid
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl import distributed
from jaxrl.rollout.base import PushVerificationError
from jaxrl.rollout.sglang.client import SGLangClient
from jaxrl.rollout.sglang.fleet import Fleet
from jaxrl.rollout.sglang.push_memory import TensorsFn
from jaxrl.rollout.sglang.tensors import consecutive_groups


class GroupPush:
    """The process-group transport of ``WeightPusher`` (module docstring)."""

    def __init__(self, fleet: Fleet, client: SGLangClient, chunk_mib: float, tensors_fn: TensorsFn,
                 address: str, port: int, backend: str, timeout_s: float):
        self.fleet = fleet
        self._client = client
        self._chunk_bytes = int(chunk_mib * 2**20)
        self._tensors_fn = tensors_fn
        self._address, self._port, self._backend = address, port, backend
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._group = None  # the torch process group, made at the first push (process 0 only)
        self._name = f"jaxrl-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # a server may outlive one run's group

    def send(self, params, version: str) -> tuple[float, dict[str, float]]:
        """Broadcasts the tensors to every server (process 0; the others only take part in the gathers);
        returns in every process when the last broadcast ended, with push/chunks and push/bytes (bytes each
        server received). With several processes they meet there: each then verifies the same servers,
        which must already hold the version process 0 sent."""
        stream = self._tensors_fn(params)
        if distributed.is_main_process():
            metrics = self._broadcast(stream, version)
        else:
            for _ in stream.arrays:  # the gathers are collectives every process enters
                pass
            metrics = {}
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxrl group push {version} sent")
        return time.perf_counter(), metrics

    def _broadcast(self, stream, version: str) -> dict[str, float]:
        torch = _torch()
        if self._group is None:
            self._group = self._connect(torch)
        what = f"weight push of version {version!r} over process group {self._name}"
        self._everywhere("/begin_weight_update", lambda i: {}, what)
        groups, arrays = consecutive_groups(stream.specs, self._chunk_bytes), iter(stream.arrays)
        device = "cuda" if self._backend == "nccl" else "cpu"
        try:
            with concurrent.futures.ThreadPoolExecutor(self.fleet.num_servers) as pool:
                for k, names in enumerate(groups):
                    last = k == len(groups) - 1
                    body = {"names": names, "dtypes": [str(np.dtype(stream.specs[n][1])) for n in names],
                            "shapes": [list(stream.specs[n][0]) for n in names], "group_name": self._name,
                            "weight_version": version if last else None, "flush_cache": last}
                    loads = [pool.submit(self._client.request, i, "POST", "/update_weights_from_distributed", body,
                                         what) for i in range(self.fleet.num_servers)]
                    for want in names:
                        name, array = next(arrays)
                        if name != want:
                            raise ValueError(f"the tensor stream announced {want!r} but gave {name!r}")
                        torch.distributed.broadcast(_as_torch(torch, array).to(device), src=0, group=self._group)
                    for i, load in enumerate(loads):
                        result = load.result()
                        if not result.get("success", False):
                            raise PushVerificationError(f"{self.fleet.describe(i)}: {what} failed: "
                                                        f"{result.get('message')!r}")
        finally:
            self._everywhere("/end_weight_update", lambda i: {}, what)
        nbytes = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                     for shape, dtype in stream.specs.values())
        return {"push/chunks": len(groups), "push/bytes": nbytes}

    def verified(self, version: str) -> None:
        """Nothing to keep: servers started elsewhere are not restarted by jaxrl."""

    def reload(self, index: int) -> None:
        """Nothing to do: servers started elsewhere are not restarted by jaxrl."""

    def close(self) -> None:
        """Leaves the group on both sides (a server may serve the next run)."""
        if self._group is None:
            return
        torch = _torch()
        try:
            self._everywhere("/destroy_weights_update_group", lambda i: {"group_name": self._name},
                             f"closing process group {self._name}")
        finally:
            torch.distributed.destroy_process_group(self._group)
            self._group = None

    def _connect(self, torch):
        """Forms the group: every server joins through ``/init_weights_update_group`` (in threads,
        each call returns once all ranks met) while this process joins as rank 0."""
        ranks = self.fleet.config.tensor_parallel
        world = 1 + ranks * self.fleet.num_servers
        port = self._port or _free_port()
        with concurrent.futures.ThreadPoolExecutor(self.fleet.num_servers) as pool:
            joins = [pool.submit(self._client.request, i, "POST", "/init_weights_update_group", {
                "master_address": self._address, "master_port": port, "rank_offset": 1 + ranks * i,
                "world_size": world, "group_name": self._name, "backend": self._backend},
                f"joining process group {self._name} at {self._address}:{port}") for i in range(self.fleet.num_servers)]
            group = _new_group(torch, self._backend, f"tcp://{self._address}:{port}", world, self._name, self._timeout)
            for i, join in enumerate(joins):
                result = join.result()
                if not result.get("success", False):
                    raise PushVerificationError(
                        f"{self.fleet.describe(i)} could not join process group {self._name} at "
                        f"{self._address}:{port}: {result.get('message')!r}; check that it reaches that address "
                        f"(PushConfig.group_address) and the backend {self._backend!r} (gloo on CPU, nccl on GPUs)")
        return group

    def _everywhere(self, route: str, body: Callable[[int], dict], what: str) -> list[Any]:
        return self._client.map([(i, "POST", route, body(i), what) for i in range(self.fleet.num_servers)])


def _new_group(torch, backend: str, init_method: str, world_size: int, name: str, timeout: datetime.timedelta):
    """Rank 0 of a process group of its own (not the default group), formed exactly as SGLang's
    ``init_custom_process_group`` forms the servers' side: one TCP store, prefixed with the group's name."""
    from torch.distributed import distributed_c10d as c10d

    store, rank, world_size = next(c10d.rendezvous(init_method, 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(name, store), group_name=name,
                                              backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _as_torch(torch, array: np.ndarray):
    """A contiguous torch tensor of ``array`` (bfloat16, which ml_dtypes holds, through its bits)."""
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _torch():
    try:
        import torch
        import torch.distributed  # noqa: F401
    except ImportError as err:
        raise ImportError("PushConfig.method=distributed needs torch in the learner's environment "
                          f"(pip install torch): {err}") from None
    return torch
