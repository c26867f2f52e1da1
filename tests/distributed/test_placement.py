"""The placement section: the shipped GPU layouts on 2 and 4 hosts of 8 GPUs, what ``--dry-run``
prints, and every layout that cannot fit refused at load naming its key and numbers.

Nothing here starts JAX devices or servers: a plan is arithmetic on the config
(``jaxrl.trainer.plan.host_plans``), and the learner's devices are picked from stand-in device
records (``learner_devices`` reads only their process index, id and platform).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.distributed import MeshMismatchError
from jaxrl.distributed.placement import PlacementConfig, learner_devices, learner_environment
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.plan import host_plans

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_8B = os.path.join(REPO, "configs", "qwen3_8b_grpo_gpu.yaml")
GPU_30B = os.path.join(REPO, "configs", "qwen3_30b_a3b_gspo_gpu.yaml")

# (config, overrides, hosts, learner GPUs per host, servers per host, GPUs per server)
LAYOUTS = [
    (GPU_8B, [], 2, 4, 4, 1),
    (GPU_8B, ["placement.hosts=4", "mesh.fsdp=16"], 4, 4, 4, 1),
    (GPU_30B, ["placement.hosts=2", "mesh.expert=4"], 2, 4, 1, 4),
    (GPU_30B, [], 4, 4, 1, 4),
]


@pytest.mark.parametrize("path, overrides, hosts, learner, servers, tp", LAYOUTS)
def test_shipped_gpu_configs_use_every_gpu_once_and_never_give_a_learner_gpu_to_a_server(
        path, overrides, hosts, learner, servers, tp):
    config = load_config(TrainConfig, path, overrides)
    plans = host_plans(config)
    assert len(plans) == hosts
    ports = set()
    for host in plans:
        assert len(host.learner_devices) == learner and len(host.servers) == servers
        server_gpus = [gpu for server in host.servers for gpu in server.devices]
        assert sorted(list(host.learner_devices) + server_gpus) == list(range(8))  # every GPU, once
        assert not set(host.learner_devices) & set(server_gpus)
        for server in host.servers:
            assert len(server.devices) == tp
            assert server.environment["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, server.devices))
            argv = list(server.argv)
            assert argv[1:3] == ["-m", "sglang.launch_server"]
            assert ("--tp-size" in argv) == (tp > 1) and (tp == 1 or argv[argv.index("--tp-size") + 1] == str(tp))
            assert argv[argv.index("--mem-fraction-static") + 1] == "0.85"
            assert argv[argv.index("--device") + 1] == "cuda"
            ports.add(server.url)
    assert len(ports) == hosts * servers
    assert config.mesh.size == hosts * learner


def test_a_scheduler_numbering_maps_each_server_to_the_job_gpus():
    config = load_config(TrainConfig, GPU_8B)
    plan = host_plans(config, environ={"CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15"})[1]
    assert [s.environment["CUDA_VISIBLE_DEVICES"] for s in plan.servers] == ["12", "13", "14", "15"]


def test_dry_run_prints_every_host_plan_and_starts_nothing():
    # JAX_PLATFORMS=cuda on a machine without CUDA: creating any JAX device here would fail the command.
    result = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", GPU_30B, "--dry-run", "placement.hosts=2",
                             "mesh.expert=4"], capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, "JAX_PLATFORMS": "cuda"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "placement: 2 host(s) x 8 devices" in out and "host 1 (process 1):" in out
    assert out.count("CUDA_VISIBLE_DEVICES=4,5,6,7 ") == 2
    assert "--tp-size 4" in out and "--enable-return-routed-experts" in out
    assert "learner: local devices 0,1,2,3" in out


@pytest.mark.parametrize("overrides, message", [
    (["placement.server_tensor_parallel=3"],
     r"placement.server_tensor_parallel=3 must be a divisor of the 4 devices per host for servers"),
    (["placement.learner_devices=[0,1,2,3,4,5,6,7]", "mesh.fsdp=16"],
     r"placement gives every one of the 8 devices per host to the learner"),
    (["placement.hosts=4"], r"mesh .* spans 8 devices, but placement gives the learner 16 \(placement.hosts=4 x 4"),
    (["placement.learner_devices=[0,1,2,8]"], r"placement.learner_devices=\(0, 1, 2, 8\) must be distinct local "
                                               r"device ids in \[0, placement.devices_per_host=8\)"),
    (["placement.learner_devices=[0,0,1,2]"], r"placement.learner_devices=.* must be distinct"),
    (["rollout.sglang.server.num_servers=8"], r"rollout.sglang.server.num_servers=8 is decided by the placement"),
    (["rollout.sglang.server.tensor_parallel=2"], r"rollout.sglang.server.tensor_parallel=2 is decided"),
    (["placement.colocate=true"], r"placement.learner_memory_fraction=None must be set with placement.colocate"),
    (["placement.colocate=true", "placement.learner_memory_fraction=0.5"],
     r"placement.server_memory_fraction=0.85 must be at most 0.45"),
    (["placement.server_memory_fraction=1.5"], r"placement.server_memory_fraction=1.5 must be a share"),
    (["rollout.engine=embedded"], r"placement lays out the SGLang servers .* has rollout.engine='embedded'"),
    (["rollout.sglang.server.extra_args=[--tp, '4']"], r"extra_args: --tp is set by ServerConfig.tensor_parallel"),
])
def test_layouts_that_do_not_fit_are_refused_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, GPU_8B, overrides)


def test_colocated_servers_share_the_learner_gpu_and_count_its_memory():
    config = load_config(TrainConfig, GPU_8B, [
        "placement.hosts=1", "placement.devices_per_host=1", "placement.learner_devices=[0]", "mesh.fsdp=1",
        "placement.colocate=true", "placement.learner_memory_fraction=0.4", "placement.server_memory_fraction=0.45"])
    (host,) = host_plans(config)
    assert host.learner_devices == (0,) and [s.devices for s in host.servers] == [(0,)]
    assert host.learner_environment == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"}
    argv = list(host.servers[0].argv)
    # SGLang counts the learner's reservation as used memory: its static fraction is the two together.
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.85"
    assert learner_environment(config.placement) == host.learner_environment


@dataclasses.dataclass(frozen=True)
class _Device:
    process_index: int
    id: int
    platform: str


def test_the_mesh_takes_each_process_learner_devices_in_process_order():
    placement = PlacementConfig(hosts=2, devices_per_host=3, learner_devices=(0, 1))
    cpu = [_Device(p, 10 * p + i, "cpu") for p in (1, 0) for i in (2, 1, 0)]  # any order, as JAX may list them
    assert [(d.process_index, d.id) for d in learner_devices(placement, 2, cpu)] == [(0, 0), (0, 1), (1, 10), (1, 11)]
    # On GPUs JAX was restricted before it started: what each process sees is the learner's.
    gpu = [_Device(p, 4 * p + i, "gpu") for p in (0, 1) for i in range(2)]
    assert len(learner_devices(placement, 2, gpu)) == 4
    with pytest.raises(MeshMismatchError, match=r"placement.hosts=2 but 3 process\(es\) were launched"):
        learner_devices(placement, 3, cpu)
    with pytest.raises(MeshMismatchError, match=r"placement.devices_per_host=3 but process 0 has 4 CPU devices"):
        learner_devices(placement, 2, cpu + [_Device(0, 3, "cpu")])
    with pytest.raises(MeshMismatchError, match=r"JAX sees 3 devices on process 0"):
        learner_devices(placement, 2, gpu + [_Device(0, 9, "gpu")])
