"""Two real JAX processes on 127.0.0.1 (4 CPU devices each) against one process with 8 devices."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlp_worker  # noqa: E402

# Float32 sums over 8 devices reduced through gloo across processes instead of
# in one process: same terms, another order, so equal to float32 rounding.
ATOL = 1e-6


def test_two_processes_train_like_one_process_and_checkpoint_restores_in_one(processes, tmp_path):
    processes.start_workers("train", tmp_path)
    for result in processes.wait_all(timeout_s=60):
        assert result.returncode == 0, result.output

    info = json.load(open(tmp_path / "info.json"))
    assert info["process_count"] == 2 and info["device_count"] == 8
    two = np.load(tmp_path / "params.npz")
    init, x, _ = mlp_worker.problem()
    # The global batch assembled from the two processes' rows is the data, row for row.
    np.testing.assert_array_equal(two["x"], x)

    params, _, losses = mlp_worker.train(mlp_worker.make_mesh())  # one process, this test's 8 devices
    np.testing.assert_allclose(info["losses"], losses, rtol=0, atol=ATOL)
    for name, value in params.items():
        assert not np.allclose(np.asarray(value), init[name]), f"{name} did not train"
        np.testing.assert_allclose(two[name], np.asarray(value), rtol=0, atol=ATOL, err_msg=name)

    # The checkpoint both processes wrote restores here, onto one device.
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=single) for name, value in init.items()}
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as manager:
        assert manager.latest_step() == mlp_worker.STEPS
        restored = manager.restore(mlp_worker.STEPS, args=ocp.args.StandardRestore(target))
    for name in init:
        np.testing.assert_array_equal(np.asarray(restored[name]), two[name], err_msg=name)


def test_a_failure_in_one_process_stops_the_other_with_its_error(processes, tmp_path):
    for failing in (1, 0):  # a worker, then the coordinator's own process
        processes.start_workers(f"fail:{failing}", tmp_path / f"fail{failing}")
    results = processes.wait_all(timeout_s=40)
    for failing, pair in zip((1, 0), (results[:2], results[2:]), strict=True):
        for index, result in enumerate(pair):
            assert result.returncode == 1, result.output
            assert f"ValueError: deliberate failure in process {failing}" in result.output, result.output
            if index != failing:
                assert f"process {index} stops because process {failing}" in result.output, result.output
            assert "finished a collective" not in result.output


def test_fewer_processes_than_num_processes_is_reported_before_jax_gives_up(processes, tmp_path):
    processes.start_workers("join", tmp_path, count=2, ids=(0,), extra=("--distributed-timeout", "1"))
    (result,) = processes.wait_all(timeout_s=40)
    assert result.returncode != 0
    assert "still waiting for 2 processes to join the coordinator at 127.0.0.1:" in result.output
    assert "--num-processes / JAX_NUM_PROCESSES must equal the number launched" in result.output
