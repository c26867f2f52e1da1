"""Several JAX processes as one program: start-up, checks, global batches, failures.

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
value to change when it does not fit). Host data reaches a sharded ``jit`` in
one of two ways (plain numpy inputs are refused there): every process holds
the same value and places it with ``jax.device_put(x, sharding)`` (the
trainer does this: every process reads the same global batch), or each process
holds only its own rows (:func:`process_rows`) and :func:`global_batch`
assembles them. Results come back with :func:`to_host` (``np.asarray`` fails
on an array spread over several processes). Host work split over processes
(SGLang rollouts: each process drives its own servers) takes
:func:`process_share` of the items, and :func:`allgather_ragged` gives every
process the whole result in item order. Logs and plots come from process
0 (:func:`is_main_process`, :func:`main_process_only`); a failure in one
process stops all of them with that process's error
(:func:`stop_all_on_failure`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import math
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

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

# Keys in the coordination service's key-value store used to pass a failure.
_FAILURE_KEY = "jaxrl/failure"
_FAILURE_ACK_KEY = "jaxrl/failure_ack/{}"
# How long a failing process waits for the others to read its error before it exits.
_FAILURE_ACK_TIMEOUT_S = 10.0
_FAILURE_POLL_S = 0.5  # per process, against the coordinator: keep it light for large pods


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
        if name is None or config.cluster not in ("auto", name) or (config.cluster == "auto" and env.opt_in_only_method):
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
            f"after {0.9 * config.timeout_s:g} s (timeout {config.timeout_s} s); JAX will stop this process. Check that "
            f"{expected} processes were launched (--num-processes / {ENV_NUM_PROCESSES} must equal the number "
            f"launched) and that each has a distinct --process-id / {ENV_PROCESS_ID}.",
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
            resolved.coordinator_address, resolved.num_processes, resolved.process_id)) if value is None)
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


def process_rows(sharding: jax.sharding.Sharding, global_shape: Sequence[int]) -> np.ndarray:
    """Indices of the rows (axis 0) of a global array of ``global_shape`` this process must supply.

    Sorted, as :func:`jax.make_array_from_process_local_data` expects the
    process-local array to hold them. Processes whose devices are replicas
    along axis 0 get the same rows.
    """
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows.update(range(*index[0].indices(global_shape[0])))
    return np.array(sorted(rows), dtype=np.int64)


def global_batch(shardings: Any, local_batch: Any, global_batch_size: int) -> Any:
    """Assembles global arrays from each process's rows (a pytree of numpy arrays).

    ``shardings``: one ``jax.sharding.Sharding`` for every leaf, or a matching
    tree (a prefix). Every leaf has the batch on axis 0; its local rows are the
    ones :func:`process_rows` names, in that order.
    """
    leaves, treedef = jax.tree.flatten(local_batch)
    sharding_leaves = (
        [shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding)
        else treedef.flatten_up_to(shardings)
    )
    arrays = []
    for leaf, sharding in zip(leaves, sharding_leaves):
        leaf = np.asarray(leaf)
        global_shape = (global_batch_size,) + leaf.shape[1:]
        expected = len(process_rows(sharding, global_shape))
        if leaf.shape[0] != expected:
            raise ValueError(
                f"process {jax.process_index()} supplied {leaf.shape[0]} rows of a global batch of "
                f"{global_batch_size}, but its devices hold {expected} rows under {sharding}; feed the rows "
                f"process_rows() names (global batch size / number of data-parallel processes)"
            )
        arrays.append(jax.make_array_from_process_local_data(sharding, leaf, global_shape))
    return treedef.unflatten(arrays)


def to_host(tree: Any) -> Any:
    """The full value of every array in ``tree`` as numpy, on every process.

    ``np.asarray`` works only on arrays this process holds entirely (or fully
    replicated ones); a global array sharded over several processes is
    gathered from all of them (a collective: every process must call this).
    """
    from jax.experimental import multihost_utils  # noqa: PLC0415

    def fetch(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(fetch, tree)


def is_main_process() -> bool:
    """True on process 0, the one that writes logs, TensorBoard events and plots."""
    return jax.process_index() == 0


def main_process_only(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: runs ``function`` on process 0 only; elsewhere the call returns None."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs) if is_main_process() else None

    return wrapper


def _jax_state():
    """JAX's distributed state: the coordination client and address live only in this private global."""
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    return jax_distributed.global_state


def _coordination_client():
    """The coordination service's client (its key-value store), or None with one process."""
    return _jax_state().client


class _FailureWatch:
    """Polls the key-value store for another process's failure and exits this one with it."""

    def __init__(self, client, process_index: int, coordinator_address: str | None):
        self._client = client
        self._process_index = process_index
        self._address = coordinator_address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxrl-failure-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        unreachable_since = None
        while not self._stop.wait(_FAILURE_POLL_S):
            try:
                message = self._client.key_value_try_get(_FAILURE_KEY)
            except Exception as error:  # NOT_FOUND until someone fails; other errors: lost the coordinator
                if str(error).startswith("NOT_FOUND"):
                    unreachable_since = None
                    continue
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > 5.0 and not self._stop.is_set():
                    self._exit(
                        f"lost the coordinator at {self._address} (process 0), which most likely failed; "
                        f"see process 0's log. Last error: {error}"
                    )
                continue
            if self._stop.is_set():
                return
            with contextlib.suppress(Exception):
                self._client.key_value_set(_FAILURE_ACK_KEY.format(self._process_index), "1")
            self._exit(message)

    def _exit(self, message: str) -> None:
        print(f"jaxrl.distributed: process {self._process_index} stops because {message}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


@contextlib.contextmanager
def stop_all_on_failure() -> Iterator[None]:
    """Makes an exception in one process stop every process, each printing that process's error.

    Without it the others wait in their next collective until the
    coordinator's heartbeat gives up (minutes), with no word of the cause.
    The failing process publishes its traceback, waits briefly for the others
    to read it, prints it and exits with status 1 (``os._exit``: a normal exit
    would hang in JAX's shutdown barrier, which the others never reach). With
    one process the exception propagates as usual.
    """
    client = _coordination_client()
    if client is None or jax.process_count() == 1:
        yield
        return
    index, count = jax.process_index(), jax.process_count()
    watch = _FailureWatch(client, index, _jax_state().coordinator_address)
    watch.start()
    try:
        yield
    except BaseException as error:
        if isinstance(error, SystemExit) and error.code in (None, 0):
            raise
        watch.stop()
        details = "".join(traceback.format_exception(error))
        message = f"process {index} ({socket.gethostname()}) failed:\n{details}"
        with contextlib.suppress(Exception):  # another process may have failed first
            client.key_value_set(_FAILURE_KEY, message)
        deadline = time.monotonic() + _FAILURE_ACK_TIMEOUT_S
        for other in range(count):
            remaining_ms = int(1000 * (deadline - time.monotonic()))
            if other != index and remaining_ms > 0:
                with contextlib.suppress(Exception):
                    client.blocking_key_value_get(_FAILURE_ACK_KEY.format(other), remaining_ms)
        print(f"jaxrl.distributed: {message}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        watch.stop()


def process_share(num_items: int, process_index: int | None = None, process_count: int | None = None) -> slice:
    """The contiguous slice of ``num_items`` items that process ``process_index`` handles.

    Items are split in process order, the first ``num_items % process_count``
    processes taking one more (as ``np.array_split``), so the slices in process
    order concatenate to ``range(num_items)``; a process may get none.
    """
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if not 0 <= index < count:
        raise ValueError(f"process_share: process_index={index} is outside 0..{count - 1} (process_count={count})")
    base, extra = divmod(num_items, count)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


def allgather_ragged(arrays: Sequence[np.ndarray], dtype: Any, trailing_shape: Sequence[int] = ()) -> list[np.ndarray]:
    """Every process's ``arrays`` concatenated in process order, on every process (a collective).

    ``arrays``: this process's arrays of ``dtype``, each ``[length_k, *trailing_shape]``
    with any ``length_k`` (ragged), any number of them (none too). They travel as
    bytes padded to the longest process's total, so any dtype comes back bit for
    bit (``process_allgather`` alone would turn int64/float64 into 32 bits
    unless x64 is on). With one process the arrays come back as given. Every
    process must call this with the same ``dtype`` and ``trailing_shape``.
    """
    dtype, trailing_shape = np.dtype(dtype), tuple(int(d) for d in trailing_shape)
    local = [np.asarray(a) for a in arrays]
    for k, array in enumerate(local):
        if array.dtype != dtype or array.ndim < 1 or array.shape[1:] != trailing_shape:
            raise ValueError(
                f"allgather_ragged: array {k} of process {jax.process_index()} is {array.dtype}{list(array.shape)}; "
                f"expected {dtype}[length, {', '.join(map(str, trailing_shape))}] like every other array")
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils  # noqa: PLC0415

    def gather(x: np.ndarray) -> np.ndarray:  # [P, *x.shape]
        return np.asarray(multihost_utils.process_allgather(x, tiled=False))

    counts = gather(np.asarray([len(local)], np.int32))[:, 0]
    lengths = np.full(int(counts.max()), -1, np.int32)
    lengths[:len(local)] = [a.shape[0] for a in local]
    all_lengths = gather(lengths)
    row_bytes = dtype.itemsize * math.prod(trailing_shape)
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in local)
    size = int(all_lengths.clip(min=0).sum(axis=1).max()) * row_bytes
    padded = np.zeros(max(size, 1), np.uint8)
    padded[:len(payload)] = np.frombuffer(payload, np.uint8)
    all_bytes = gather(padded)
    result = []
    for process, count in enumerate(counts):
        offset = 0
        for length in all_lengths[process, :count]:
            chunk = all_bytes[process, offset:offset + length * row_bytes]
            result.append(chunk.view(dtype).reshape((int(length), *trailing_shape)).copy())
            offset += length * row_bytes
    return result
