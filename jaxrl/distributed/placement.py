"""Placement: which of each host's devices the learner's JAX process owns, and how the rest become SGLang servers.

A GPU cluster run is one JAX process per host, every host laid out the same way (the config's
``placement`` section, :class:`PlacementConfig`):

- ``learner_devices``: the local GPUs JAX uses on every host. JAX is restricted to them before it
  starts (:func:`restrict_learner_devices`), and the global mesh covers exactly these devices of
  all hosts (:func:`learner_devices`): ``hosts x len(learner_devices)`` devices.
- The host's other devices are cut, in order, into servers of ``server_tensor_parallel`` devices
  each (:attr:`PlacementConfig.server_devices`); each host's process starts, watches and restarts
  its own servers, each seeing only its devices (``CUDA_VISIBLE_DEVICES``, :func:`visible_devices`).
- ``colocate: true`` puts the servers on the learner's own devices instead (a single-GPU machine,
  or a node whose memory both fit in): JAX then takes ``learner_memory_fraction`` of each GPU's
  memory and each server ``server_memory_fraction`` for its weights and KV cache.

On CPU (the tests) the "devices" are XLA's host devices: the learner's are picked from each
process's local devices by index, and the servers are CPU servers with no device environment.
Every check here is arithmetic on the config, so a layout that does not fit is refused at load.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

from jaxrl.distributed.startup import MeshMismatchError
from jaxrl.errors import InputError

# JAX's GPU allocator reads this when its backend starts: the share of each GPU it reserves.
ENV_MEMORY_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# What would leave a colocated GPU without room for the activations and CUDA contexts of both.
MAX_COLOCATED_FRACTION = 0.95


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Every host's devices: the learner's, then SGLang servers (module docstring).

    hosts: the hosts (one JAX process each) this layout is for; a run launched on another
      number of processes is refused before it starts.
    devices_per_host: GPUs on each host (XLA host devices on CPU).
    learner_devices: local device ids the learner's JAX process owns on every host.
    server_tensor_parallel: devices per SGLang server (its ``--tp-size``).
    server_memory_fraction: share of each of a server's GPUs for its weights and KV cache
      (``--mem-fraction-static``; with ``colocate`` the learner's share is added, since SGLang
      counts memory other processes hold against it); None: SGLang's default.
    colocate: servers on the learner's devices (a single-GPU machine) instead of the others.
    learner_memory_fraction: share of each GPU's memory JAX reserves (XLA_PYTHON_CLIENT_MEM_FRACTION);
      required with ``colocate``; None otherwise leaves JAX's default.
    """

    devices_per_host: int
    learner_devices: tuple[int, ...]
    hosts: int = 1
    server_tensor_parallel: int = 1
    server_memory_fraction: float | None = None
    colocate: bool = False
    learner_memory_fraction: float | None = None

    def __post_init__(self):
        def bad(key, expected):
            raise _field_error(key, getattr(self, key), expected)

        object.__setattr__(self, "learner_devices", tuple(int(d) for d in self.learner_devices))
        if self.hosts < 1:
            bad("hosts", ">= 1")
        if self.devices_per_host < 1:
            bad("devices_per_host", ">= 1")
        if not self.learner_devices or len(set(self.learner_devices)) != len(self.learner_devices) or not all(
                0 <= d < self.devices_per_host for d in self.learner_devices):
            bad("learner_devices", f"distinct local device ids in [0, placement.devices_per_host="
                                   f"{self.devices_per_host}), at least one")
        if self.server_tensor_parallel < 1:
            bad("server_tensor_parallel", ">= 1")
        for key in ("server_memory_fraction", "learner_memory_fraction"):
            value = getattr(self, key)
            if value is not None and not 0 < value < 1:
                bad(key, "a share of each GPU's memory in (0, 1), or null")
        if self.colocate:
            self._check_colocated()
        pool = self._server_pool()
        if len(pool) % self.server_tensor_parallel:
            where = ("the learner's" if self.colocate else
                     f"the devices placement.learner_devices={list(self.learner_devices)} leaves of "
                     f"placement.devices_per_host={self.devices_per_host}, so")
            bad("server_tensor_parallel", f"a divisor of the {len(pool)} devices per host for servers ({where} "
                                          f"{len(pool)}); choose another tensor-parallel size or learner_devices")

    def _check_colocated(self) -> None:
        for key in ("learner_memory_fraction", "server_memory_fraction"):
            if getattr(self, key) is None:
                raise _field_error(key, None, "set with placement.colocate=true: the learner and the servers "
                                   "share each GPU, so each needs its share of its memory")
        total = self.learner_memory_fraction + self.server_memory_fraction
        if total > MAX_COLOCATED_FRACTION:
            raise _field_error("server_memory_fraction", self.server_memory_fraction,
                               f"at most {MAX_COLOCATED_FRACTION - self.learner_memory_fraction:.2f}: with "
                               f"placement.learner_memory_fraction={self.learner_memory_fraction} the two take "
                               f"{total:.2f} of each GPU, and the rest ({1 - MAX_COLOCATED_FRACTION:.2f} at least) "
                               "is for CUDA contexts and activations")

    def _server_pool(self) -> tuple[int, ...]:
        if self.colocate:
            return self.learner_devices
        return tuple(d for d in range(self.devices_per_host) if d not in self.learner_devices)

    @property
    def server_devices(self) -> tuple[tuple[int, ...], ...]:
        """Each server's local device ids, the same on every host, in server order."""
        pool, tp = self._server_pool(), self.server_tensor_parallel
        return tuple(pool[i:i + tp] for i in range(0, len(pool), tp))

    @property
    def servers_per_host(self) -> int:
        return len(self.server_devices)

    @property
    def learner_device_count(self) -> int:
        """Devices the global mesh spans: every host's learner devices."""
        return self.hosts * len(self.learner_devices)

    def sglang_memory_fraction(self) -> float | None:
        """``--mem-fraction-static``: SGLang counts what other processes hold on its GPU as used,
        so a colocated server's fraction includes the learner's share."""
        if self.server_memory_fraction is None:
            return None
        return round(self.server_memory_fraction + (self.learner_memory_fraction if self.colocate else 0.0), 6)

    def check_mesh(self, mesh_shape: dict[str, int]) -> None:
        """The mesh must span exactly the learner devices of all hosts (ValueError naming both)."""
        size = 1
        for value in mesh_shape.values():
            size *= value
        if size != self.learner_device_count:
            raise ValueError(f"mesh {mesh_shape} spans {size} devices, but placement gives the learner "
                             f"{self.learner_device_count} (placement.hosts={self.hosts} x {len(self.learner_devices)} "
                             f"placement.learner_devices): the mesh spans exactly the learner's devices; change a "
                             f"mesh axis or the placement")


def _field_error(key: str, value, expected: str) -> ValueError:
    return ValueError(f"placement.{key}={value!r} must be {expected}")


def learner_environment(placement: PlacementConfig) -> dict[str, str]:
    """What the learner's process environment must hold before JAX starts (its memory share)."""
    if placement.learner_memory_fraction is None:
        return {}
    return {ENV_MEMORY_FRACTION: f"{placement.learner_memory_fraction:g}"}


def restrict_learner_devices(placement: PlacementConfig, on_gpu: bool) -> tuple[int, ...] | None:
    """Called before JAX starts: sets the learner's memory share and, on GPUs, the devices JAX may
    use (returned, for ``jax.distributed.initialize(local_device_ids=...)``, and set through
    ``jax_cuda_visible_devices`` for one process). On CPU nothing is restricted: the learner's
    devices are picked by :func:`learner_devices`."""
    os.environ.update(learner_environment(placement))
    if not on_gpu:
        return None
    import jax

    jax.config.update("jax_cuda_visible_devices", ",".join(map(str, placement.learner_devices)))
    return placement.learner_devices


def learner_devices(placement: PlacementConfig, process_count: int, devices) -> list:
    """The global mesh's devices, process by process: each process's learner devices. ``devices``:
    ``jax.devices()``. On GPUs JAX already sees only the learner's, on CPU they are picked by index."""
    if process_count != placement.hosts:
        raise MeshMismatchError(f"placement.hosts={placement.hosts} but {process_count} process(es) were launched: "
                                "the layout is one process per host; launch one per host or change placement.hosts")
    chosen = []
    for process in range(process_count):
        local = sorted((d for d in devices if d.process_index == process), key=lambda d: d.id)
        if local and local[0].platform == "cpu":
            if len(local) != placement.devices_per_host:
                raise MeshMismatchError(f"placement.devices_per_host={placement.devices_per_host} but process "
                                        f"{process} has {len(local)} CPU devices; make them agree")
            local = [local[i] for i in placement.learner_devices]
        elif len(local) != len(placement.learner_devices):
            raise MeshMismatchError(f"placement.learner_devices={list(placement.learner_devices)} but JAX sees "
                                    f"{len(local)} devices on process {process}: JAX must be restricted to the "
                                    "learner's before it starts (jaxrl train does this)")
        chosen += local
    return chosen


def visible_devices(local_ids: tuple[int, ...], environ=os.environ) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a server on these local device ids: local id i is the i-th GPU
    this process sees, so a job whose scheduler gave it ``CUDA_VISIBLE_DEVICES=2,3,...`` maps
    through that list."""
    given = [v for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not given:
        return ",".join(map(str, local_ids))
    if max(local_ids) >= len(given):
        raise InputError(f"placement puts a server on local GPU {max(local_ids)}, but CUDA_VISIBLE_DEVICES="
                         f"{','.join(given)} gives this host {len(given)}; lower placement.devices_per_host or ask "
                         "the scheduler for the host's GPUs")
    return ",".join(given[i].strip() for i in local_ids)


def host_gpu_count(environ=os.environ) -> int | None:
    """GPUs this host gives the job: ``CUDA_VISIBLE_DEVICES``'s, else ``nvidia-smi -L``'s; None when
    neither can say."""
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return len([v for v in given.split(",") if v.strip()])
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))
