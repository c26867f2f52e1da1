"""Checkpoints: round trip, keep-last-K, a crash mid-save, restore onto another mesh."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.trainer.checkpoint import CheckpointConfig, Checkpointer


def _state(mesh, spec, scale=1.0):
    w = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * scale, NamedSharding(mesh, spec))
    return {"params": {"w": w}, "opt_state": (jnp.float32(scale),), "step": jnp.int32(3)}


def test_round_trip_keep_and_restore_on_other_mesh(tmp_path):
    devices = np.asarray(jax.devices()[:8])
    mesh_a = Mesh(devices.reshape(2, 4), ("x", "y"))
    mesh_b = Mesh(devices.reshape(8, 1), ("x", "y"))
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path / "ck"), keep=2))
    for step in (1, 2, 3):
        ckpt.save(step, _state(mesh_a, P("x", "y"), scale=step), {"step": step, "data": {"next_index": step}})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    target = _state(mesh_b, P(None, "x"), scale=0.0)
    state, meta = ckpt.restore(target)
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.arange(64).reshape(8, 8) * 3.0)
    assert state["params"]["w"].sharding == target["params"]["w"].sharding  # Landed on the new mesh.
    assert float(state["opt_state"][0]) == 3.0 and int(state["step"]) == 3
    assert meta == {"step": 3, "data": {"next_index": 3}}
    ckpt.close()


def test_crash_mid_save_leaves_previous_checkpoint_usable(tmp_path):
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    directory = tmp_path / "ck"
    ckpt = Checkpointer(CheckpointConfig(directory=str(directory), async_save=False))
    ckpt.save(5, _state(mesh, P(), scale=5.0), {"step": 5})
    ckpt.close()
    # What a process killed during the next save leaves behind: a half-written temporary folder.
    partial = directory / "6.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\0" * 10)
    reopened = Checkpointer(CheckpointConfig(directory=str(directory)))
    assert reopened.latest_step() == 5
    state, meta = reopened.restore(_state(mesh, P(), scale=0.0))
    assert meta == {"step": 5} and float(state["opt_state"][0]) == 5.0
    reopened.close()


def test_restore_without_checkpoint_is_an_error(tmp_path):
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path / "empty")))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.restore({"x": jnp.zeros(2)})
    ckpt.close()


def test_a_bucket_url_reaches_orbax_unchanged(monkeypatch):
    """checkpoint.directory: gs://... (the TPU pod config) must not become a local relative folder."""
    import orbax.checkpoint as ocp

    given = []
    monkeypatch.setattr(ocp, "CheckpointManager", lambda directory, options: given.append(directory))
    Checkpointer(CheckpointConfig(directory="gs://bucket/run/checkpoints"))
    assert given == ["gs://bucket/run/checkpoints"]


def test_asyncio_reports_of_a_full_disks_futures_are_held_back():
    """The CI run's leak: a save that failed with ENOSPC inside tensorstore leaves futures whose
    exceptions asyncio reports when they are collected, with no Orbax frame in their traceback; only
    Orbax's temporary folder names them. They are held back (the run already said it in one line);
    asyncio's other reports are not."""
    import logging

    from jaxrl.trainer.checkpoint import _OrbaxFailureReports

    reports = _OrbaxFailureReports()
    error = ValueError('RESOURCE_EXHAUSTED: Error writing "params.final_norm.weight.value/0" in OCDBT database '
                       'at local file "/tmp/run/disk/ck/2.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/'
                       'ocdbt.process_0/": No space left on device [os_error_code=\'28\']')

    def record(message, exc):
        return logging.LogRecord("asyncio", logging.ERROR, "/usr/lib/python3.11/asyncio/base_events.py", 1, message,
                                 None, (type(exc), exc, None))

    leaked = record(f"Future exception was never retrieved\nfuture: <Future finished exception={error!r}>", error)
    assert reports.filter(leaked) is False and reports.failed.startswith("Future exception was never retrieved")
    other = ValueError("a user's own coroutine failed")
    assert reports.filter(record("Task exception was never retrieved", other)) is True
