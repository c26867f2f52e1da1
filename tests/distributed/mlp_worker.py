"""One process of the two-process tests: a sharded MLP trained with optax over a global batch.

Run as ``python mlp_worker.py MODE OUT_DIR [distributed flags]``; imported by the
tests for the one-process reference (``train``). Modes:
- ``train``: a few AdamW steps on an 8-device (data, fsdp, tensor) mesh with
  the batch assembled from process-local rows; writes the gathered batch and
  parameters (process 0) and an Orbax checkpoint (all processes).
- ``fail:K``: process K raises inside ``stop_all_on_failure`` while the
  others wait in a collective that needs it.
- ``join``: only initialises and reports (used when not every process starts).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

from jaxrl import distributed

MESH_SHAPE = {"data": 2, "fsdp": 2, "tensor": 2}
GLOBAL_BATCH, D_IN, D_HIDDEN, D_OUT = 16, 6, 8, 4
STEPS = 3
PARAM_SPECS = {"w1": ("fsdp", "tensor"), "b1": ("tensor",), "w2": ("tensor", "fsdp"), "b2": (None,)}
BATCH_SPEC = (("data", "fsdp"), None)


def make_mesh() -> jax.sharding.Mesh:
    devices = np.array(jax.devices()).reshape(tuple(MESH_SHAPE.values()))
    return jax.sharding.Mesh(devices, tuple(MESH_SHAPE))


def problem(seed: int = 0) -> tuple[dict, np.ndarray, np.ndarray]:
    """Initial parameters and the full global batch, the same in every process."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(D_IN, D_HIDDEN)).astype(np.float32) / np.sqrt(D_IN),
        "b1": np.zeros(D_HIDDEN, np.float32),
        "w2": rng.normal(size=(D_HIDDEN, D_OUT)).astype(np.float32) / np.sqrt(D_HIDDEN),
        "b2": np.zeros(D_OUT, np.float32),
    }
    x = rng.normal(size=(GLOBAL_BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, D_OUT)).astype(np.float32)
    return params, x, y


def train(mesh: jax.sharding.Mesh) -> tuple[dict, jax.Array, list[float]]:
    """STEPS AdamW steps; returns the sharded parameters, the global input batch and the losses."""
    import optax  # noqa: PLC0415

    named = lambda spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # noqa: E731
    param_shardings = {name: named(spec) for name, spec in PARAM_SPECS.items()}
    batch_sharding = named(BATCH_SPEC)
    init, x, y = problem()
    params = {
        name: jax.make_array_from_callback(value.shape, param_shardings[name], lambda index, v=value: v[index])
        for name, value in init.items()
    }
    rows = distributed.process_rows(batch_sharding, x.shape)
    batch = distributed.global_batch(batch_sharding, {"x": x[rows], "y": y[rows]}, GLOBAL_BATCH)

    optimizer = optax.adamw(1e-2, weight_decay=1e-3)

    def loss_fn(p, b):
        hidden = jax.nn.gelu(b["x"] @ p["w1"] + p["b1"])
        return jax.numpy.mean((hidden @ p["w2"] + p["b2"] - b["y"]) ** 2)

    @jax.jit
    def step(p, opt_state, b):
        loss, grads = jax.value_and_grad(loss_fn)(p, b)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    opt_state = optimizer.init(params)
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, batch["x"], losses


def save_checkpoint(directory: str, params: dict) -> None:
    """Every process calls this: Orbax writes each process's shards and synchronises."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    with ocp.CheckpointManager(directory) as manager:
        manager.save(STEPS, args=ocp.args.StandardSave(params))
        manager.wait_until_finished()


def main(argv: list[str]) -> int:
    mode, out_dir = argv[0], argv[1]
    info, rest = distributed.initialize_from_argv(argv[2:])
    if rest:
        raise SystemExit(f"unexpected arguments {rest}")
    with distributed.stop_all_on_failure():
        if mode == "join":
            print(json.dumps({"process_index": info.process_index, "device_count": info.device_count}))
            return 0
        mesh = make_mesh()
        distributed.check_mesh(MESH_SHAPE)
        if mode.startswith("fail:"):
            if info.process_index == int(mode[len("fail:"):]):
                raise ValueError(f"deliberate failure in process {info.process_index}")
            total = jax.jit(lambda a: a.sum())(
                distributed.global_batch(
                    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))),
                    np.ones(GLOBAL_BATCH // 2, np.float32), GLOBAL_BATCH)
            )
            print(f"process {info.process_index} finished a collective without the failed process:", float(total))
            return 0
        params, x, losses = train(mesh)
        gathered, x_gathered = distributed.to_host((params, x))
        save_checkpoint(os.path.join(out_dir, "ckpt"), params)

        @distributed.main_process_only
        def write_results():
            np.savez(os.path.join(out_dir, "params.npz"), x=x_gathered, **gathered)
            with open(os.path.join(out_dir, "info.json"), "w") as f:
                json.dump({"losses": losses, "process_count": info.process_count,
                           "device_count": info.device_count}, f)

        write_results()
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
