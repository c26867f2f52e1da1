"""Settings, checks and bad input of jaxrl.distributed (one process)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl import distributed
from jaxrl.distributed import DistributedConfig, MeshMismatchError

from jax_processes import REPO, child_env, free_port


def test_flags_override_environment_and_the_rest_is_left_in_order():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3",
           "JAX_LOCAL_DEVICE_IDS": "0,1", "JAXRL_DISTRIBUTED_TIMEOUT": "30"}
    config, rest = distributed.parse_args(
        ["configs/demo.yaml", "--process-id", "2", "steps=3", "--cluster", "none"], environ=env)
    assert config == DistributedConfig("10.0.0.2:1234", 4, 2, (0, 1), "none", 30)
    assert config.explicit
    assert rest == ["configs/demo.yaml", "steps=3"]
    assert distributed.config_from_env({}) == DistributedConfig()


@pytest.mark.parametrize("kwargs, words", [
    (dict(coordinator_address="10.0.0.2"), ["HOST:PORT", "'10.0.0.2'"]),
    (dict(coordinator_address="host:99999"), ["port in 1..65535"]),
    (dict(num_processes=2, process_id=2), ["process_id=2", "num_processes=2", "0..1"]),
    (dict(cluster="pbs"), ["cluster must be one of", "'pbs'"]),
    (dict(timeout_s=0), ["timeout", "got 0"]),
])
def test_bad_settings_name_the_setting(kwargs, words):
    with pytest.raises(ValueError) as error:
        DistributedConfig(**kwargs)
    for word in words:
        assert word in str(error.value)


def test_bad_environment_values_name_the_variable():
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer, got 'two'"):
        distributed.config_from_env({"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match="JAX_LOCAL_DEVICE_IDS must be comma-separated integers"):
        distributed.config_from_env({"JAX_LOCAL_DEVICE_IDS": "0;1"})


def test_no_settings_and_no_cluster_is_one_process_without_jax_distributed():
    info = distributed.initialize(DistributedConfig(cluster="none"))
    assert (info.method, info.process_index, info.process_count) == ("single", 0, 1)
    assert not jax.distributed.is_initialized()


def test_partial_settings_without_a_cluster_say_what_is_missing():
    with pytest.raises(ValueError, match=r"missing --coordinator-address \(or JAX_COORDINATOR_ADDRESS\)"):
        distributed.initialize(DistributedConfig(num_processes=2, process_id=0))
    with pytest.raises(ValueError, match="--cluster slurm .* JAX does not detect that cluster"):
        distributed.initialize(DistributedConfig(cluster="slurm"))


def test_mesh_larger_than_the_devices_says_which_value_to_change():
    with pytest.raises(MeshMismatchError) as error:
        distributed.check_mesh({"data": 2, "fsdp": 8}, process_count=2, local_device_count=4, key="mesh")
    message = str(error.value)
    assert "needs 16 devices" in message and "2 process(es) x 4 local devices = 8" in message
    assert "lower mesh.fsdp" in message and "--num-processes 4" in message


def test_mesh_smaller_than_the_processes_devices_says_which_value_to_change():
    with pytest.raises(MeshMismatchError) as error:
        distributed.check_mesh({"data": 1, "fsdp": 4}, process_count=2, local_device_count=4, key="mesh")
    message = str(error.value)
    assert "uses 4 of the 8 devices of 2 processes" in message
    assert "raise mesh.fsdp" in message and "--num-processes 1" in message
    distributed.check_mesh({"data": 1, "fsdp": 4}, process_count=1, local_device_count=8)  # one process: fine
    distributed.check_mesh({"data": 2, "fsdp": 2, "tensor": 2}, process_count=2, local_device_count=4)


def test_process_rows_and_global_batch_in_one_process():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    np.testing.assert_array_equal(distributed.process_rows(sharding, (6, 3)), np.arange(6))
    x = np.arange(18, dtype=np.float32).reshape(6, 3)
    batch = distributed.global_batch(sharding, {"x": x}, 6)
    np.testing.assert_array_equal(np.asarray(batch["x"]), x)
    assert batch["x"].sharding == sharding
    np.testing.assert_array_equal(distributed.to_host(batch)["x"], x)
    with pytest.raises(ValueError, match="process 0 supplied 4 rows of a global batch of 6, but its devices hold 6"):
        distributed.global_batch(sharding, {"x": x[:4]}, 6)


def test_main_process_only_runs_on_process_zero():
    calls = []
    assert distributed.main_process_only(lambda v: calls.append(v) or v)(7) == 7
    assert calls == [7] and distributed.is_main_process()


# Runs in a fresh process: initialize() must come before any device exists.
_BAD_COORDINATORS = r"""
import json, os, sys, time
from jaxrl import distributed
from jaxrl.distributed import DistributedConfig
closed_port, busy_port = int(sys.argv[1]), int(sys.argv[2])
cases = {
    "unreachable": DistributedConfig(f"127.0.0.1:{closed_port}", 2, 1, timeout_s=2),
    "busy_port": DistributedConfig(f"127.0.0.1:{busy_port}", 2, 0, timeout_s=2),
    "not_this_host": DistributedConfig(f"192.0.2.1:{closed_port}", 2, 0, timeout_s=2),
    "unknown_host": DistributedConfig(f"no-such-host.invalid:{closed_port}", 2, 0, timeout_s=2),
}
report = {}
for name, config in cases.items():
    start = time.monotonic()
    try:
        distributed.initialize(config)
        report[name] = ["no error", 0.0]
    except Exception as error:
        report[name] = [f"{type(error).__name__}: {error}", time.monotonic() - start]
slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
for name, tasks in (("slurm_two_tasks", "2"), ("slurm_one_task", "1")):  # "single" starts the devices
    os.environ.update(slurm, SLURM_NTASKS=tasks, SLURM_PROCID=str(int(tasks) - 1))
    try:
        report[name] = [distributed.initialize(DistributedConfig(timeout_s=2)).method, 0.0]
    except Exception as error:
        report[name] = [f"{type(error).__name__}: {error}", 0.0]
for key in list(slurm) + ["SLURM_NTASKS"]:
    del os.environ[key]
import jax
jax.devices()
try:
    distributed.initialize(DistributedConfig(f"127.0.0.1:{closed_port}", 2, 0))
except RuntimeError as error:
    report["after_devices"] = [str(error), 0.0]
print(json.dumps(report))
"""


def test_bad_coordinators_are_clear_errors_naming_the_address_within_the_timeout():
    closed_port = free_port()
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-c", _BAD_COORDINATORS, str(closed_port), str(busy_port)],
                             env=child_env(4), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    message, seconds = report["unreachable"]
    assert message.startswith("CoordinatorUnreachableError: cannot reach the coordinator at "
                              f"127.0.0.1:{closed_port} (process 0) within 2 s"), message
    assert "--coordinator-address / JAX_COORDINATOR_ADDRESS" in message and 1.9 < seconds < 10
    message, _ = report["busy_port"]
    assert f"port {busy_port} is already in use" in message and f"127.0.0.1:{busy_port}" in message
    message, _ = report["not_this_host"]
    assert "192.0.2.1" in message and "not an address of this machine" in message
    message, _ = report["unknown_host"]
    assert "no-such-host.invalid" in message and "does not resolve" in message
    assert "must run before anything creates JAX devices" in report["after_devices"][0]
    # Under SLURM JAX's detection finds the settings: one task is one process; with two,
    # task 1 waits for the coordinator JAX derives (first node, port from the job id).
    assert report["slurm_one_task"][0] == "single"
    assert report["slurm_two_tasks"][0].startswith(
        f"CoordinatorUnreachableError: cannot reach the coordinator at 127.0.0.1:{7 % 4096 + 61440} (process 0)")
