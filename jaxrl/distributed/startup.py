"""Start-up of several JAX processes as one program: settings, cluster detection, checks.

Call :func:`initialize` (or :func:`initialize_from_argv`) first thing in a
command, before anything creates JAX devices. It reads where the other
processes are from, in order of precedence:

1. command-line flags ``--coordinator-address HOST:PORT --num-processes N
   --process-id I [--local-device-ids 0,1] [--cluster METHOD]
   [--distributed-timeout SECONDS]``;
2. the environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
   ``JAX_PROCESS_ID``, ``JAX_LOCAL_DEVICE_IDS``, ``JAXRL_CLUSTER``,
   ``JAXRL_DISTRIBUTED_TIMEOUT`` (what the launchers in ``launch/`` set);
3. JAX's own cluster detection (TPU VM pods, SLURM with more than one task,
   Open MPI, Kubernetes) when neither says anything;
4. otherwise one process: nothing to initialise.

With several processes there is one global mesh over every process's
devices: ``jax.devices()`` lists them all, so the mesh built from a config on
one host is built from the same config on a pod (:func:`check_mesh` says which
value to change when it does not fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import math
import os
import socket
import sys
import threading
import time
from typing import Mapping, Sequence

import jax

from jaxrl.distributed import host_memory

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
ENV_CLUSTER = "JAXRL_CLUSTER"
ENV_TIMEOUT = "JAXRL_DISTRIBUTED_TIMEOUT"

# "auto": explicit settings if given, else JAX's detection, else one process.
# "none": never detect (explicit settings or one process). Any other value is
# the name of one of JAX's detection methods, required to succeed.
CLUSTER_METHODS = ("auto", "none", "slurm", "gcetpu", "gketpu", "ompi", "k8s", "mpi4py")


class CoordinatorUnreachableError(RuntimeError):
    """The coordinator (process 0's service) cannot be reached or cannot start."""


class MeshMismatchError(ValueError):
    """The configured mesh does not fit the devices of the launched processes."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits among the others; every field may be left unset.

    coordinator_address: ``"host:port"`` of process 0, which runs the
      coordination service; the same string in every process.
    num_processes: how many processes were launched in all.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    local_device_ids: restrict this process to these local accelerators
      (one process per GPU); ``None`` uses all of them.
    cluster: one of ``CLUSTER_METHODS`` (see the module docstring).
    timeout_s: seconds to wait for the coordinator and the other processes.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cluster: str = "auto"
    timeout_s: int = 300

    def __post_init__(self):
        if self.coordinator_address is not None:
            _split_address(self.coordinator_address)
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None:
            if self.process_id < 0:
                raise ValueError(f"process_id must be >= 0, got {self.process_id}")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(
                    f"process_id={self.process_id} is out of range for num_processes={self.num_processes}: "
                    f"process ids run 0..{self.num_processes - 1}; give each process a distinct id in that range"
                )
        if self.local_device_ids is not None:
            object.__setattr__(self, "local_device_ids", tuple(int(i) for i in self.local_device_ids))
            if any(i < 0 for i in self.local_device_ids):
                raise ValueError(f"local_device_ids must be >= 0, got {self.local_device_ids}")
        if self.cluster not in CLUSTER_METHODS:
            raise ValueError(f"cluster must be one of {CLUSTER_METHODS}, got {self.cluster!r}")
        if self.timeout_s < 1:
            raise ValueError(f"distributed timeout must be >= 1 second, got {self.timeout_s}")

    @property
    def explicit(self) -> bool:
        """Whether the three settings that place this process are all given."""
        return None not in (self.coordinator_address, self.num_processes, self.process_id)


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """What :func:`initialize` set up. ``method`` is "single", "explicit" or a cluster name."""

    process_index: int
    process_count: int
    local_device_count: int
    device_count: int
    coordinator_address: str | None
    method: str


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator address must be HOST:PORT with a port in 1..65535 (e.g. 10.0.0.2:8476), got {address!r}"
        )
    return host.strip("[]"), int(port)


def _int_setting(name: str, text: str | None) -> int | None:
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _device_ids_setting(name: str, text: str | None) -> tuple[int, ...] | None:
    if text is None or text == "":
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers like 0,1, got {text!r}") from None


def config_from_env(environ: Mapping[str, str] | None = None) -> DistributedConfig:
    """Reads the ``JAX_*``/``JAXRL_*`` variables listed in the module docstring."""
    env = os.environ if environ is None else environ
    timeout = _int_setting(ENV_TIMEOUT, env.get(ENV_TIMEOUT))
    return DistributedConfig(
        coordinator_address=env.get(ENV_COORDINATOR_ADDRESS) or None,
        num_processes=_int_setting(ENV_NUM_PROCESSES, env.get(ENV_NUM_PROCESSES)),
        process_id=_int_setting(ENV_PROCESS_ID, env.get(ENV_PROCESS_ID)),
        local_device_ids=_device_ids_setting(ENV_LOCAL_DEVICE_IDS, env.get(ENV_LOCAL_DEVICE_IDS)),
        cluster=env.get(ENV_CLUSTER) or "auto",
        timeout_s=300 if timeout is None else timeout,
    )


def parse_args(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[DistributedConfig, list[str]]:
    """Takes the distributed flags out of ``argv``; the environment fills what they leave unset.

    Returns the config and the remaining arguments, in their order.
    """
    base = config_from_env(environ)
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--coordinator-address", default=base.coordinator_address)
    parser.add_argument("--num-processes", default=base.num_processes, type=int)
    parser.add_argument("--process-id", default=base.process_id, type=int)
    parser.add_argument(
        "--local-device-ids",
        default=base.local_device_ids,
        type=functools.partial(_device_ids_setting, "--local-device-ids"),
    )
    parser.add_argument("--cluster", default=base.cluster, choices=CLUSTER_METHODS)
    parser.add_argument("--distributed-timeout", default=base.timeout_s, type=int)
    flags, rest = parser.parse_known_args(list(argv))
    config = DistributedConfig(
        coordinator_address=flags.coordinator_address,
        num_processes=flags.num_processes,
        process_id=flags.process_id,
        local_device_ids=flags.local_device_ids,
        cluster=flags.cluster,
        timeout_s=flags.distributed_timeout,
    )
    return config, rest


def _detect_cluster(config: DistributedConfig) -> tuple[DistributedConfig, str] | None:
    """The settings JAX's own cluster detection finds (filling what ``config`` leaves unset), or None.

    JAX has no public "which cluster am I in" query, and ``initialize()`` with
    nothing to find raises a bare "coordinator_address should be defined", so
    this asks the same registry JAX consults; the result then goes through the
    same checks as explicit settings.
    """
    from jax._src import clusters  # noqa: PLC0415 (private; see docstring)

    for env in clusters.ClusterEnv._cluster_types:  # noqa: SLF001
        name = getattr(env, "name", None)
        if (name is None or config.cluster not in ("auto", name)
                or (config.cluster == "auto" and env.opt_in_only_method)):
            continue
        try:
            present = env.is_env_present()
        except Exception:  # a detector that cannot run here (no metadata server, no mpi4py) found nothing
            present = False
        if present:
            address, count, index, device_ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(
                config.coordinator_address, config.num_processes, config.process_id,
                None if config.local_device_ids is None else list(config.local_device_ids), name, config.timeout_s,
            )
            detected = dataclasses.replace(
                config, coordinator_address=address, num_processes=count, process_id=index,
                local_device_ids=None if device_ids is None else tuple(device_ids),
            )
            return detected, name
    return None


def _check_coordinator_can_start(address: str) -> None:
    """Process 0 runs the service on ``[::]:port`` and connects to ``address``: both must work here."""
    host, port = _split_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise CoordinatorUnreachableError(
            f"coordinator address {address}: host {host!r} does not resolve ({error}); "
            f"set --coordinator-address / {ENV_COORDINATOR_ADDRESS} to process 0's host name or IP"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
        except OSError as error:
            if error.errno == errno.EADDRNOTAVAIL:
                raise CoordinatorUnreachableError(
                    f"coordinator address {address}: {host} ({sockaddr[0]}) is not an address of this machine, "
                    f"but process 0 (this process) runs the coordinator; set --coordinator-address / "
                    f"{ENV_COORDINATOR_ADDRESS} to process 0's own host"
                ) from None
            raise
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise CoordinatorUnreachableError(
                    f"coordinator address {address}: port {port} is already in use on this machine; "
                    f"choose a free port in --coordinator-address / {ENV_COORDINATOR_ADDRESS} for every process"
                ) from None
            raise


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Waits until a TCP connection to ``address`` succeeds.

    JAX's own client aborts the process (no exception, no address in the
    message) when the coordinator does not answer, so look first.
    """
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, remaining))):
                return
        except OSError as error:
            last_error = error
        if time.monotonic() >= deadline:
            raise CoordinatorUnreachableError(
                f"cannot reach the coordinator at {address} (process 0) within {timeout_s:g} s: {last_error}. "
                f"Check --coordinator-address / {ENV_COORDINATOR_ADDRESS} (process 0's host and port), that "
                f"process 0 is running and the port is open between the hosts; raise --distributed-timeout / "
                f"{ENV_TIMEOUT} if process 0 starts late"
            )
        time.sleep(0.25)


def _warn_before_join_timeout(config: DistributedConfig, address: str) -> threading.Timer:
    """JAX aborts without naming the cause when not every process joins; say it first."""
    expected = config.num_processes if config.num_processes is not None else "all"

    def warn():
        print(
            f"jaxrl.distributed: still waiting for {expected} processes to join the coordinator at {address} "
            f"after {0.9 * config.timeout_s:g} s (timeout {config.timeout_s} s); JAX will stop this process. "
            f"Check that {expected} processes were launched (--num-processes / {ENV_NUM_PROCESSES} must equal "
            f"the number launched) and that each has a distinct --process-id / {ENV_PROCESS_ID}.",
            file=sys.stderr,
            flush=True,
        )

    timer = threading.Timer(0.9 * config.timeout_s, warn)
    timer.daemon = True
    timer.start()
    return timer


def _backends_started() -> bool:
    from jax._src import xla_bridge  # noqa: PLC0415 (the only way to ask without starting them)

    return xla_bridge.backends_are_initialized()


def initialize(config: DistributedConfig | None = None) -> ProcessInfo:
    """Joins this process to the others (see the module docstring); call before touching devices.

    Raises CoordinatorUnreachableError when the coordinator cannot be reached
    within ``config.timeout_s`` (naming the address), RuntimeError when JAX
    devices already exist, ValueError for settings that contradict each other.
    """
    host_memory.before_devices()  # XLA:CPU's scratch buffers stay mapped between calls (its docstring)
    config = config_from_env() if config is None else config
    config, method = _resolve(config)
    if method == "single" or config.num_processes == 1:
        return _process_info(None, "single")
    if _backends_started():
        raise RuntimeError(
            "jaxrl.distributed.initialize() must run before anything creates JAX devices (jax.devices(), "
            "an array, a jit call at import time); call it first thing in the command's main"
        )
    if config.process_id == 0:
        _check_coordinator_can_start(config.coordinator_address)
    else:
        _wait_for_coordinator(config.coordinator_address, config.timeout_s)
    # Multi-process CPU runs need a cross-process collective implementation;
    # the setting is inert on GPU and TPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timer = _warn_before_join_timeout(config, config.coordinator_address)
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
            local_device_ids=None if config.local_device_ids is None else list(config.local_device_ids),
            cluster_detection_method="deactivate",
            initialization_timeout=config.timeout_s,
        )
    finally:
        timer.cancel()
    info = _process_info(config.coordinator_address, method)
    if info.process_count != config.num_processes:
        raise ValueError(
            f"num_processes={config.num_processes} but JAX joined {info.process_count} processes; "
            f"set --num-processes / {ENV_NUM_PROCESSES} to the number of processes launched"
        )
    return info


def _resolve(config: DistributedConfig) -> tuple[DistributedConfig, str]:
    """Complete settings and how they were found: "explicit", a cluster name, or "single"."""
    if config.explicit:
        return config, "explicit"
    given = {
        f"--coordinator-address (or {ENV_COORDINATOR_ADDRESS})": config.coordinator_address,
        f"--num-processes (or {ENV_NUM_PROCESSES})": config.num_processes,
        f"--process-id (or {ENV_PROCESS_ID})": config.process_id,
    }
    missing = ", ".join(flag for flag, value in given.items() if value is None)
    alone = config.num_processes in (None, 1) and config.coordinator_address is None
    if config.cluster == "none":
        if alone:
            return config, "single"
        raise ValueError(f"--cluster none needs explicit settings: missing {missing}")
    detected = _detect_cluster(config)
    if detected is not None:
        resolved, name = detected
        if resolved.explicit:
            return resolved, name
        missing = ", ".join(flag for flag, value in zip(given, (
            resolved.coordinator_address, resolved.num_processes, resolved.process_id), strict=True) if value is None)
        raise ValueError(f"JAX detected a {name} cluster but could not find {missing}; give them explicitly")
    if config.cluster != "auto":
        raise ValueError(
            f"--cluster {config.cluster} (or {ENV_CLUSTER}) was asked for but JAX does not detect that cluster "
            f"here; launch inside it, or give --coordinator-address, --num-processes and --process-id instead"
        )
    if alone:
        return config, "single"
    raise ValueError(
        f"several processes need all of --coordinator-address, --num-processes and --process-id, and no "
        f"cluster JAX can detect (SLURM, TPU pod) was found; missing {missing}"
    )


def _process_info(coordinator_address: str | None, method: str) -> ProcessInfo:
    return ProcessInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
        coordinator_address=coordinator_address,
        method=method,
    )


def initialize_from_argv(argv: Sequence[str]) -> tuple[ProcessInfo, list[str]]:
    """:func:`parse_args` then :func:`initialize`; returns the info and the other arguments."""
    config, rest = parse_args(argv)
    return initialize(config), rest


def shutdown() -> None:
    """Leaves the group cleanly (a barrier with the others); a no-op for one process."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def check_mesh(
    mesh_shape: Mapping[str, int],
    *,
    process_count: int | None = None,
    local_device_count: int | None = None,
    key: str = "mesh",
) -> None:
    """Raises MeshMismatchError unless the mesh uses exactly the processes' devices.

    One process may use fewer devices than it has (a test on one of eight);
    several processes must use every device, or some process would hold none
    of the global arrays. ``key`` is the config key the message names.
    """
    processes = jax.process_count() if process_count is None else process_count
    local = jax.local_device_count() if local_device_count is None else local_device_count
    available = processes * local
    size = math.prod(mesh_shape.values())
    shape = dict(mesh_shape)
    largest = max(shape, key=shape.get) if shape else None
    fitting_processes = f", or launch {size // local} processes (--num-processes {size // local})" \
        if size % local == 0 else ""
    if size > available:
        raise MeshMismatchError(
            f"{key} {shape} needs {size} devices but {processes} process(es) x {local} local devices = "
            f"{available} are available: lower {key}.{largest} (or another {key} axis) so that the axes "
            f"multiply to {available}{fitting_processes}"
        )
    if processes > 1 and size < available:
        raise MeshMismatchError(
            f"{key} {shape} uses {size} of the {available} devices of {processes} processes x {local} local "
            f"devices; with several processes every device must be in the mesh: raise {key}.{largest} so "
            f"that the axes multiply to {available}{fitting_processes}"
        )
