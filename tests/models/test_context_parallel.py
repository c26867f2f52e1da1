"""Ulysses context parallelism (docs/models.md#context-parallelism) on 8 CPU devices: the full forward and
the gradients of a hybrid (softmax + lightning + gated DeltaNet + MoE) decoder,
with packed rows whose segments cross the sequence shards, equal the one-device result, over meshes
sequence=8 (key/value heads repeated, DeltaNet heads padded) and data=2 x sequence=4 (a plan with tensor
shards is in `test_switch`);
the same inside scanned layers; the switch; and the per-device temporary memory of a forward + backward
shrinks with the sequence shards.

float32; tolerance 1e-5 of each array's largest magnitude: the sharded run sums partial gradients in
another order and its projections see T/s rows, which XLA:CPU rounds differently (~4e-7 on the first
layer's output, Ulysses and the partitioner's path alike). Gated DeltaNet amplifies that rounding: two of
its layers, or heads of 8, put some gradients ~2e-5 off on either path, so the hybrid has one layer of
heads of 16 (measured: logits 1.3e-6, gradients <= 2.1e-6 of their scale).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, MeshConfig, ModelConfig, make_mesh, shard_model
from jaxrl.models import context_parallel as cp

ROW = 32  # 4 tokens per shard at sequence=8
# Row 0: segments crossing shard borders, then padding. Row 1: padding first and between segments.
# Row 2: one sequence. Row 3: many short segments (several per shard).
LAYOUTS = ([(1, 5), (2, 13), (3, 9), (0, 5)], [(0, 3), (1, 10), (0, 2), (2, 11), (3, 6)], [(1, 32)],
           [(1, 3), (2, 4), (3, 2), (4, 7), (5, 1), (6, 6), (7, 5), (0, 4)])
MESHES = {"sp8": MeshConfig(sequence=8), "dp2-sp4": MeshConfig(data=2, sequence=4)}
DENSE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=8, num_kv_heads=2,
                    head_dim=8, rope_theta=10000.0, attention_block_size=8)
HYBRID = DENSE.replace(
    num_layers=4, layer_types=("lightning_attention", "gated_deltanet", "full_attention", "lightning_attention"),
    mlp_types=("dense", "moe", "dense", "dense"), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, shared_expert_gate=True,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_chunk_size=4, attention_output_gate=True, partial_rotary_factor=0.5, norm_weight_offset=True)


def packed_batch():
    segment_ids, positions = np.zeros((len(LAYOUTS), ROW), np.int32), np.zeros((len(LAYOUTS), ROW), np.int32)
    for row, layout in enumerate(LAYOUTS):
        start = 0
        for segment, length in layout:
            segment_ids[row, start:start + length] = segment
            positions[row, start:start + length] = np.arange(length) if segment else 0
            start += length
        assert start == ROW
    ids = np.random.default_rng(0).integers(0, DENSE.vocab_size, (len(LAYOUTS), ROW)).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segment_ids)


def randomize(model, seed):
    """O(1) activations: matrices ~ N(0, 1 / fan_in) / 2, vectors their init + 0.3 N, A_log = log U(0.1, 2.1)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    new = []
    for (path, value), key in zip(leaves, jax.random.split(jax.random.key(seed), len(leaves)), strict=True):
        noise = jax.random.normal(key, value.shape, jnp.float32)
        if "A_log" in jax.tree_util.keystr(path):
            value = jnp.log(jax.random.uniform(key, value.shape, jnp.float32, 0.1, 2.1))
        elif value.ndim == 1:
            value = value + 0.3 * noise
        else:
            value = 0.5 * noise / np.sqrt(value.shape[-2])
        new.append(value)
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))
    return model


def logits_and_grads(model, ids, positions, segment_ids):
    def loss(model):
        logits = model.logits(ids, positions, segment_ids)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.roll(ids, -1, axis=1)[..., None], axis=-1)[..., 0]
        mask = (segment_ids != 0).astype(jnp.float32)
        return -jnp.sum(logp * mask) / jnp.sum(mask), logits

    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return logits, nnx.state(grads)


@pytest.fixture(scope="module")
def reference():
    """The hybrid holds a softmax layer too (query groups of 4 on 2 key/value heads), so one model proves
    every token mixer; a dense decoder on a sequence mesh is tests/models/test_sharding.py's dp2-sp4."""
    model = randomize(Decoder(HYBRID, rngs=nnx.Rngs(1)), seed=2)
    batch = packed_batch()
    logits, grads = nnx.jit(logits_and_grads)(model, *batch)
    return model, batch, np.asarray(logits), jax.tree.map(np.asarray, grads)


def assert_close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    scale = np.abs(want).max()
    assert scale > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_context_parallel_forward_and_gradients_equal_one_device(reference, mesh_name):
    model, batch, logits, grads = reference
    mesh = make_mesh(MESHES[mesh_name])
    sharded, _ = shard_model(nnx.clone(model), mesh)
    with jax.set_mesh(mesh):
        step = nnx.jit(logits_and_grads)
        text = step.lower(sharded, *batch).as_text()
        got_logits, got_grads = step(sharded, *batch)
    assert "all_to_all" in text  # the Ulysses path ran
    assert np.abs(logits).max() > 1.0
    assert_close(got_logits, logits)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    for path, have, want in zip(paths, jax.tree.leaves(got_grads), jax.tree.leaves(grads), strict=True):
        assert np.abs(want).max() > 0, path
        assert_close(have, want)


def test_switch():
    mesh = make_mesh(MeshConfig(sequence=8))
    with jax.set_mesh(mesh):
        assert cp.plan("auto", 2, 32) == cp.Plan(("sequence",), ("tensor",), 8, 8)
        assert cp.plan("auto", 2, 36) is None  # 8 does not divide T: the partitioner's path
        assert cp.plan("none", 2, 32) is None
        with pytest.raises(ValueError, match="context_parallel = 'ulysses'.*divide the sequence length 36"):
            cp.plan("ulysses", 2, 36)
    with jax.set_mesh(make_mesh(MeshConfig(tensor=2, sequence=4))):
        assert cp.plan("ulysses", 2, 32) == cp.Plan(("sequence",), ("tensor",), 4, 8)
    with jax.set_mesh(make_mesh(MeshConfig(data=8))):
        assert cp.plan("auto", 8, 32) is None
        assert cp.plan("ulysses", 8, 32).shards == 1
    assert cp.plan("auto", 2, 32) is None  # no mesh
    with pytest.raises(ValueError, match="context_parallel = 'ulysses' needs a mesh"):
        cp.plan("ulysses", 2, 32)
    assert [cp.kv_repeat(2, 4, m) for m in (1, 2, 4, 8, 16)] == [1, 1, 2, 4, 4]

    with pytest.raises(ValueError, match=r"context_parallel = 'striped'; choose one of \['auto', 'none', 'ulysses', "
                                         r"'ring'\]"):
        DENSE.replace(context_parallel="striped")
    exported = DENSE.replace(context_parallel="none").to_hf()
    assert not any("context" in key or "parallel" in key for key in exported)
    assert ModelConfig.from_hf(exported, context_parallel="none").context_parallel == "none"

    model = Decoder(DENSE.replace(context_parallel="none"), rngs=nnx.Rngs(0))
    sharded, _ = shard_model(model, mesh)
    with jax.set_mesh(mesh):
        text = nnx.jit(lambda m, *b: m.logits(*b)).lower(sharded, *packed_batch()).as_text()
    assert "all_to_all" not in text


def temp_bytes(model, batch, mesh):
    with jax.set_mesh(mesh):
        sharded, _ = shard_model(nnx.clone(model), mesh)
        graphdef, state = nnx.split(sharded)

        def step(state, ids, positions, segment_ids):
            return logits_and_grads(nnx.merge(graphdef, state), ids, positions, segment_ids)[1]

        return jax.jit(step).lower(state, *batch).compile().memory_analysis().temp_size_in_bytes


def test_per_device_temp_memory_shrinks_with_the_sequence_shards():
    """Compiled forward + backward at T = 2048 (chunked attention, blocks of 256): per-device temporaries
    with sequence=8 against one device."""
    length = 2048
    config = DENSE.replace(vocab_size=128, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=2,
                           head_dim=16, attention_impl="chunked", attention_block_size=256)
    model = Decoder(config, rngs=nnx.Rngs(0))
    ids = jnp.zeros((1, length), jnp.int32)
    batch = (ids, jnp.arange(length, dtype=jnp.int32)[None], jnp.ones((1, length), jnp.int32))
    one = temp_bytes(model, batch, make_mesh(MeshConfig()))
    eight = temp_bytes(model, batch, make_mesh(MeshConfig(sequence=8)))
    print(f"temp bytes per device: one device {one}, sequence=8 {eight}, ratio {eight / one:.3f}")
    assert eight < one / 4


def test_context_parallel_inside_scanned_layers():
    """``scan_layers`` (docs/models.md#scanned-layers) runs the Ulysses all-to-alls inside the scanned
    block body: a dense decoder on data=2 x sequence=4 equals its unrolled one-device self."""
    model = randomize(Decoder(DENSE, rngs=nnx.Rngs(1)), seed=2)
    batch = packed_batch()
    logits, grads = nnx.jit(logits_and_grads)(model, *batch)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(DENSE.replace(scan_layers=True), rngs=nnx.Rngs(0))))
    mesh = make_mesh(MESHES["dp2-sp4"])
    scanned, _ = shard_model(nnx.merge(graphdef, nnx.state(nnx.clone(model))), mesh)
    unrolled, _ = shard_model(nnx.clone(model), mesh)
    with jax.set_mesh(mesh):
        step = nnx.jit(logits_and_grads)
        all_to_alls = [step.lower(m, *batch).as_text().count("all_to_all") for m in (unrolled, scanned)]
        got_logits, got_grads = step(scanned, *batch)
    assert 0 < all_to_alls[1] < all_to_alls[0]  # Ulysses, in one scanned body instead of one per layer
    assert_close(got_logits, logits)
    for have, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads), strict=True):
        assert_close(have, want)
