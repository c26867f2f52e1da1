"""What ``jaxrl train CONFIG --dry-run`` prints: every host's learner devices and SGLang servers.

:func:`host_plans` lays out a config's hosts as the run will (``placement``; one process per
host), with each server's exact command line and the environment it adds to the process's own;
:func:`describe_plan` writes that for a reader. Nothing is started and no JAX device is created,
so a cluster layout can be read, and checked, on a laptop.
"""

from __future__ import annotations

import dataclasses
import shlex

from jaxrl.distributed.placement import learner_environment
from jaxrl.rollout.sglang.launch import INITIAL_WEIGHT_VERSION, ServerConfig
from jaxrl.trainer.config import TrainConfig

# Set per server but not worth a reader's line: the launcher's own bookkeeping.
_QUIET_ENV = ("JAXRL_SGLANG_PARENT_PID",)


@dataclasses.dataclass(frozen=True)
class ServerPlan:
    """One SGLang server: its URL, local GPUs (() when not placed), the command that starts it
    (``sglang.launch_server``, as the launcher runs it) and the variables it sets or changes."""

    url: str
    devices: tuple[int, ...]
    argv: tuple[str, ...]
    environment: dict[str, str]


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """One host (= one jaxrl process): the learner's local devices (None: all JAX sees), the
    variables its process sets before JAX starts, and its servers."""

    process: int
    learner_devices: tuple[int, ...] | None
    learner_environment: dict[str, str]
    servers: tuple[ServerPlan, ...]


def host_plans(config: TrainConfig, environ: dict[str, str] | None = None) -> list[HostPlan]:
    """Every host's plan; ``environ``: the environment the servers inherit ({} shows what they set)."""
    environ = {} if environ is None else environ
    placement = config.placement
    hosts = 1 if placement is None else placement.hosts
    plans = []
    for process in range(hosts):
        servers = ()
        if config.rollout.engine == "sglang" and config.rollout.sglang.server is not None:
            server = config.rollout.sglang.server
            server = server.placed(placement, process) if placement is not None else _offset(server, process)
            servers = tuple(_server_plan(server, i, environ) for i in range(server.num_servers))
        plans.append(HostPlan(process, None if placement is None else placement.learner_devices,
                              {} if placement is None else learner_environment(placement), servers))
    return plans


def _offset(server: ServerConfig, process: int) -> ServerConfig:
    return dataclasses.replace(server, base_port=server.base_port + process * server.num_servers)


def _server_plan(server: ServerConfig, index: int, environ: dict[str, str]) -> ServerPlan:
    env = server.environment(index=index, base=environ)
    added = {k: v for k, v in env.items() if environ.get(k) != v and k not in _QUIET_ENV}
    argv = (server.python_executable, "-m", "sglang.launch_server",
            *server.launch_args(server.ports[index], server.model_path, INITIAL_WEIGHT_VERSION))
    return ServerPlan(server.urls[index], server.devices[index] if server.devices else (), argv, added)


def describe_plan(config: TrainConfig) -> str:
    """The plan as text: per host, the learner's devices and each server's GPUs and command line."""
    placement, mesh = config.placement, dataclasses.asdict(config.mesh)
    lines = [f"mesh {' '.join(f'{k}={v}' for k, v in mesh.items())}: {config.mesh.size} learner devices"]
    external = config.rollout.sglang.external if config.rollout.engine == "sglang" else None
    if external is not None:
        lines.append(f"SGLang servers started elsewhere: {', '.join(external.urls)} (weights by "
                     f"push.method={config.rollout.sglang.push.method})")
    if placement is None:
        lines.append("no placement section: one process per host whose JAX uses its first devices"
                     + ("" if external is not None else "; the SGLang servers see every GPU of the host"))
    else:
        where = "on the learner's devices" if placement.colocate else "on the other devices"
        lines.append(f"placement: {placement.hosts} host(s) x {placement.devices_per_host} devices, one jaxrl "
                     f"process per host; {placement.servers_per_host} SGLang server(s) per host {where}, "
                     f"{placement.server_tensor_parallel} device(s) each")
    for host in host_plans(config):
        lines.append(f"host {host.process} (process {host.process}):")
        learner = "all devices JAX sees" if host.learner_devices is None else \
            f"local devices {','.join(map(str, host.learner_devices))}"
        extra = "".join(f" {k}={v}" for k, v in host.learner_environment.items())
        lines.append(f"  learner: {learner}{' (env' + extra + ')' if extra else ''}")
        for i, server in enumerate(host.servers):
            gpus = f"GPUs {','.join(map(str, server.devices))}" if server.devices else "devices not placed"
            lines.append(f"  server {i}: {server.url}, {gpus}")
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(server.environment.items()))
            lines.append(f"    {env + ' ' if env else ''}{shlex.join(server.argv)}")
    if placement is not None and config.rollout.sglang.server.device == "cuda":
        lines.append("GPU numbers are each host's own, mapped through the job's CUDA_VISIBLE_DEVICES when the "
                     "scheduler sets it; the API key (when any) reaches each server through its environment, "
                     "never its command line")
    return "\n".join(lines)
