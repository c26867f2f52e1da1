"""Several JAX processes as one program: start-up, checks, global batches, failures.

Every public name is importable from here (``from jaxrl import distributed;
distributed.initialize()``); the code lives in four modules:

- :mod:`jaxrl.distributed.startup`: joining the processes before any JAX
  device exists (:func:`initialize`, :func:`initialize_from_argv`,
  :func:`parse_args`, :func:`config_from_env`, :class:`DistributedConfig`,
  :class:`ProcessInfo`, :func:`shutdown`), where the settings come from
  (flags, environment, cluster detection), the coordinator checks, and
  :func:`check_mesh`, which says how a mesh must fit the processes' devices;
- :mod:`jaxrl.distributed.hosts`: host data in and out of global arrays
  (:func:`process_rows`, :func:`global_batch`, :func:`to_host`,
  :func:`gather_to_hosts`), host work
  split over processes (:func:`process_share`, :func:`allgather_ragged`) and
  the process that logs (:func:`is_main_process`, :func:`main_process_only`);
- :mod:`jaxrl.distributed.failure`: :func:`stop_all_on_failure`, which makes
  an exception in one process stop every process with that process's error;
- :mod:`jaxrl.distributed.host_memory`: on CPU, XLA's scratch buffers stay
  mapped between calls (``initialize`` and the trainers set it up).
"""

from jaxrl.distributed.failure import stop_all_on_failure
from jaxrl.distributed.hosts import (
    allgather_ragged,
    gather_to_hosts,
    global_batch,
    is_main_process,
    main_process_only,
    process_rows,
    process_share,
    to_host,
)
from jaxrl.distributed.startup import (
    CLUSTER_METHODS,
    ENV_CLUSTER,
    ENV_COORDINATOR_ADDRESS,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TIMEOUT,
    CoordinatorUnreachableError,
    DistributedConfig,
    MeshMismatchError,
    ProcessInfo,
    check_mesh,
    config_from_env,
    initialize,
    initialize_from_argv,
    parse_args,
    shutdown,
)

__all__ = [
    "CLUSTER_METHODS",
    "ENV_CLUSTER",
    "ENV_COORDINATOR_ADDRESS",
    "ENV_LOCAL_DEVICE_IDS",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_TIMEOUT",
    "CoordinatorUnreachableError",
    "DistributedConfig",
    "MeshMismatchError",
    "ProcessInfo",
    "allgather_ragged",
    "check_mesh",
    "config_from_env",
    "gather_to_hosts",
    "global_batch",
    "initialize",
    "initialize_from_argv",
    "is_main_process",
    "main_process_only",
    "parse_args",
    "process_rows",
    "process_share",
    "shutdown",
    "stop_all_on_failure",
    "to_host",
]
