"""Sharded forward/backward on 8 CPU devices equals the single-device result; parameters are
sharded as LOGICAL_AXIS_RULES says; the pjit train step donates and keeps shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl.models import Decoder, MeshConfig, ModelConfig, create_sharded_model, make_mesh, shard_model
from jaxrl.models.sharding import FAST_COMPILE_INIT_PARAMETERS, init_compiler_options
from jaxrl.trainer.update import make_train_step

CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_types=("moe", "dense"), num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=16, tie_word_embeddings=False)
BATCH, LENGTH = 8, 8

FSDP = ("fsdp", "sequence")  # the "embed" rule: parameters shard over fsdp and context-parallel devices


def make_batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG.vocab_size, (BATCH, LENGTH)).astype(np.int32)
    segments = np.ones((BATCH, LENGTH), np.int32)
    segments[1, :3] = 0  # left padding
    segments[2, 4:] = 2  # a packed second sequence
    positions = np.zeros_like(segments)  # counted from 0 within each segment, 0 on padding
    for row in range(BATCH):
        for segment in set(segments[row].tolist()) - {0}:
            where = np.flatnonzero(segments[row] == segment)
            positions[row, where] = np.arange(len(where))
    return {"input_ids": ids, "positions": positions.astype(np.int32), "segment_ids": segments,
            "targets": np.roll(ids, -1, axis=1), "mask": (segments != 0).astype(np.float32)}


def loss_fn(model, batch):
    logp, _, out = model.token_logprobs(batch["input_ids"], batch["positions"], batch["segment_ids"], batch["targets"],
                                        chunk_size=BATCH * LENGTH, vocab_chunk_size=None)
    nll = -jnp.sum(logp * batch["mask"]) / jnp.sum(batch["mask"])
    return nll + CONFIG.router_aux_loss_coef * out.aux_loss, {"nll": nll}


def logits_and_grads(model, batch):
    logits = model.logits(batch["input_ids"], batch["positions"], batch["segment_ids"])
    grads = nnx.grad(lambda m: loss_fn(m, batch)[0])(model)
    return logits, nnx.state(grads)


@pytest.fixture(scope="module")
def reference():
    model, _ = create_sharded_model(lambda: Decoder(CONFIG, rngs=nnx.Rngs(0)), make_mesh(MeshConfig()))
    batch = make_batch()
    logits, grads = nnx.jit(logits_and_grads)(model, batch)
    return model, batch, np.asarray(logits), jax.tree.map(np.asarray, grads)


def assert_grads_close(got, expected):
    assert len(got) == len(expected)
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(np.asarray(have), want, atol=2e-6, rtol=1e-4)


MESHES = {"data8": MeshConfig(data=8), "fsdp2-ep4": MeshConfig(fsdp=2, expert=4),
          "dp2-sp4": MeshConfig(data=2, sequence=4)}


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_logits_and_grads_equal_single_device(reference, name):
    model, batch, logits, grads = reference
    mesh = make_mesh(MESHES[name])
    sharded, _ = shard_model(nnx.clone(model), mesh)
    with jax.set_mesh(mesh):
        got_logits, got_grads = nnx.jit(logits_and_grads)(sharded, batch)
        lowered = nnx.jit(lambda m, b: m.logits(b["input_ids"], b["positions"], b["segment_ids"])).lower(
            sharded, batch).as_text()
    np.testing.assert_allclose(np.asarray(got_logits), logits, atol=2e-5, rtol=0)
    assert_grads_close(jax.tree.leaves(got_grads), jax.tree.leaves(grads))
    # expert parallelism (shard_map: all-gather tokens, local experts, reduce-scatter) iff expert > 1
    assert ("reduce_scatter" in lowered) == (MESHES[name].expert > 1)


def test_train_step_on_dp_fsdp_tp_mesh_equals_single_device_sgd(reference):
    """Mesh (2,2,2,1,1): one pjit SGD step (lr 1) gives params - grads of the single-device
    run, the state keeps its shardings and is donated; the forward's logits match too."""
    model, batch, logits, grads = reference
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    step, state = make_train_step(model, optax.sgd(1.0), loss_fn, mesh)
    before = state["params"]["layers"][0]["mlp"]["gate_proj"][...]
    new_state, metrics = step(state, batch)
    assert before.is_deleted()  # donated; the reference model's own buffers are untouched
    assert int(new_state["step"]) == 1 and np.isfinite(float(metrics["loss"]))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    new_params = jax.tree.leaves(new_state["params"])
    assert_grads_close([np.asarray(p) - np.asarray(q) for p, q in zip(params, new_params, strict=True)],
                       jax.tree.leaves(grads))
    got = new_state["params"]["layers"][0]["mlp"]["gate_proj"][...]
    assert got.sharding.spec == P("expert", FSDP, "tensor")  # size-1 axes stay in the spec
    sharded, _ = shard_model(nnx.clone(model), mesh)
    with jax.set_mesh(mesh):
        got_logits = nnx.jit(lambda m, b: m.logits(b["input_ids"], b["positions"], b["segment_ids"]))(sharded, batch)
    np.testing.assert_allclose(np.asarray(got_logits), logits, atol=2e-5, rtol=0)


def test_parameters_are_sharded_as_the_rules_say(reference):
    model, *_ = reference
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    sharded, _ = shard_model(nnx.clone(model), mesh)
    expected = {  # path: (spec, per-device shard shape)
        ("embed",): (P("tensor", FSDP), (64, 16)),
        ("lm_head",): (P(FSDP, "tensor"), (16, 64)),
        ("layers", 0, "attn", "q_proj"): (P(FSDP, "tensor", None), (16, 2, 8)),
        ("layers", 0, "attn", "k_proj"): (P(FSDP, "tensor", None), (16, 1, 8)),
        ("layers", 0, "attn", "o_proj"): (P("tensor", None, FSDP), (2, 8, 16)),
        ("layers", 0, "attn", "q_norm", "weight"): (P(None), (8,)),
        ("layers", 0, "mlp", "router"): (P(FSDP, None), (16, 8)),
        ("layers", 0, "mlp", "gate_proj"): (P("expert", FSDP, "tensor"), (4, 16, 8)),
        ("layers", 0, "mlp", "down_proj"): (P("expert", "tensor", FSDP), (4, 8, 16)),
        ("layers", 1, "mlp", "up_proj"): (P(FSDP, "tensor"), (16, 32)),
        ("final_norm", "weight"): (P(None), (32,)),
    }
    flat = dict(nnx.to_flat_state(nnx.state(sharded)))
    for path, (spec, shard_shape) in expected.items():
        array = flat[path][...]
        assert array.sharding.spec == spec, path
        assert array.addressable_shards[0].data.shape == shard_shape, path
        assert len({s.device for s in array.addressable_shards}) == 8


def test_adam_moments_inherit_parameter_shardings(reference):
    model, *_ = reference
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    _, state = make_train_step(nnx.clone(model), optax.adam(1e-3), loss_fn, mesh)
    mu = state["opt_state"][0].mu["layers"][0]["mlp"]["gate_proj"][...]
    assert mu.sharding.spec == P("expert", FSDP, "tensor")


def test_bad_meshes_name_the_numbers(reference):
    model, *_ = reference
    with pytest.raises(ValueError, match="needs 16 devices.*only 8"):
        make_mesh(MeshConfig(data=4, tensor=4))
    with pytest.raises(ValueError, match=r"kv_heads.*size 2.*total size 4"):
        shard_model(nnx.clone(model), make_mesh(MeshConfig(tensor=4)))
    with pytest.raises(ValueError, match="MeshConfig.fsdp must be a positive integer, got 0"):
        MeshConfig(fsdp=0)


def test_expert_parallel_buffers_follow_the_devices_share(monkeypatch):
    """Expert parallelism over 4 devices: each device's experts take about a quarter of the gathered
    token-expert assignments, and its MoE buffers are sized for chunks of them, not for all: the
    gradient's temporaries are under half those of the layer sized for every assignment (one chunk),
    whose buffers grow with all the devices' tokens."""
    from jaxrl.models import moe

    config = CONFIG.replace(hidden_size=64, num_experts_per_tok=4, moe_intermediate_size=128, mlp_types=("moe", "moe"))
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    model, _ = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(0)), mesh)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (8, 512)).astype(np.int32)
    positions = np.broadcast_to(np.arange(512, dtype=np.int32), ids.shape)

    def temp(chunks_per_shard: int) -> int:
        monkeypatch.setattr(moe, "CHUNKS_PER_EXPERT_SHARD", chunks_per_shard)
        with jax.set_mesh(mesh):
            gradient = nnx.jit(nnx.grad(lambda m: jnp.sum(m(ids, positions).hidden ** 2)))
            return gradient.lower(model).compile().memory_analysis().temp_size_in_bytes

    chunked, whole = temp(2), temp(0)
    assert chunked < 0.5 * whole, (chunked, whole)


def test_a_small_models_init_compiles_unoptimised_on_a_cpu_to_the_same_values():
    """create_sharded_model compiles a small model's random init for a CPU without LLVM's optimisations
    (most of a CPU run's start: FAST_COMPILE_INIT_PARAMETERS) and gets the fully optimised init's draws to
    float32's last bits (LLVM's optimisations round the normal draws' arithmetic differently: about 4% of
    the matrices' values 1 or 2 ulp apart, the norms' ones equal); a model above the bound, or another
    platform, compiles with XLA's defaults."""
    build = lambda: Decoder(CONFIG, rngs=nnx.Rngs(0))
    small = nnx.split(nnx.eval_shape(build))[1]
    assert init_compiler_options(small, "cpu") == {"xla_backend_optimization_level": 0,
                                                   "xla_llvm_disable_expensive_passes": True}
    assert init_compiler_options(small, "gpu") == {} == init_compiler_options(small, "tpu")
    wide = CONFIG.replace(vocab_size=FAST_COMPILE_INIT_PARAMETERS // CONFIG.hidden_size)  # two such tables
    assert init_compiler_options(nnx.split(nnx.eval_shape(lambda: Decoder(wide, rngs=nnx.Rngs(0))))[1], "cpu") == {}
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)  # the suite's cheaper pipeline off: users' default
    jax.clear_caches()
    try:
        model, _ = create_sharded_model(build, make_mesh(MeshConfig()))
        init = lambda: nnx.split(build())[1]
        unoptimised = jax.jit(init, compiler_options=init_compiler_options(small, "cpu"))()
        optimised = jax.jit(init)()
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
        jax.clear_caches()
    ours = jax.tree.leaves(nnx.state(model))
    assert len(ours) == len(jax.tree.leaves(optimised)) > 0
    for a, b, c in zip(ours, jax.tree.leaves(unoptimised), jax.tree.leaves(optimised), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(c), maxulp=2)
