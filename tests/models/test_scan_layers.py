"""``ModelConfig.scan_layers``: the full forward's blocks as one ``lax.scan`` over stacked weights.

The scanned forward is the unrolled one's arithmetic in another order of compilation, so logprobs,
gradients, captured activations, MoE routes and replayed routes agree to float32 rounding; what
changes is the program: one block body whatever the depth (its matmul count does not grow with
the layers), which is what lets a 48-layer train step compile in bounded host memory.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, MeshConfig, ModelConfig, create_sharded_model, make_mesh
from jaxrl.models.decoder import stack_blocks

DENSE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=8)
MOE = DENSE.replace(remat="full", mlp_types=("moe",) * 3, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=16, shared_expert_intermediate_size=8)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
SEGMENTS = jnp.asarray([[0, 0, 1, 1, 1, 2, 2, 2, 2], [1] * 9], jnp.int32)  # left padding and two packed samples


def pair(config):
    """The same weights as an unrolled and a scanned model (sharded weights: tests/trainer/test_moe_training.py)."""
    model, _ = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(0)), make_mesh(MeshConfig()))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(config.replace(scan_layers=True), rngs=nnx.Rngs(0))))
    return model, nnx.merge(graphdef, nnx.state(model))


def loss(model, routes=None):
    logp, entropy, out = model.token_logprobs(IDS, POSITIONS, SEGMENTS, jnp.roll(IDS, -1, axis=1),
                                              routed_experts=routes)
    return jnp.sum(logp * (SEGMENTS != 0)) + jnp.mean(entropy) + out.aux_loss + out.router_z_loss


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe-remat"])
def test_scanned_forward_and_gradients_equal_the_unrolled(config):
    unrolled, scanned = pair(config)
    grad = nnx.jit(nnx.value_and_grad(loss))
    (l1, g1), (l2, g2) = grad(unrolled), grad(scanned)
    assert float(l2) == pytest.approx(float(l1), rel=1e-6)
    assert_trees_close(g1, g2, atol=1e-5)
    run = nnx.jit(lambda m: m(IDS, POSITIONS, SEGMENTS, capture=True))
    a, b = run(unrolled), run(scanned)
    assert sorted(a.activations) == sorted(b.activations)
    assert_trees_close(a.activations, b.activations, atol=1e-5)
    if config.num_experts:
        np.testing.assert_array_equal(b.routed_experts, a.routed_experts)
        assert float(b.aux_loss) == pytest.approx(float(a.aux_loss), rel=1e-6)


def test_replayed_routes_reach_every_scanned_layer():
    """Replaying routes that differ from the routers' own choice: both forms use the given experts
    layer for layer, and report the routers' own top-k apart from them (the replayed update through
    the trainer: tests/trainer/test_moe_training.py)."""
    unrolled, scanned = pair(MOE)
    own = unrolled(IDS, POSITIONS, SEGMENTS).routed_experts
    routes = (own + 1) % MOE.num_experts  # another expert at every (position, layer, slot)
    forward = nnx.jit(lambda m, r: m.token_logprobs(IDS, POSITIONS, SEGMENTS, IDS, routed_experts=r))
    (a, _, out_a), (b, _, out_b) = forward(unrolled, routes), forward(scanned, routes)
    assert float(jnp.max(jnp.abs(a - forward(unrolled, None)[0]))) > 1e-3  # replay changes the logprobs
    np.testing.assert_allclose(b, a, atol=1e-5)
    for out in (out_a, out_b):
        np.testing.assert_array_equal(out.routed_experts, routes)
        np.testing.assert_array_equal(out.router_experts, own)


def _dot_count(config, layers):
    config = config.replace(num_layers=layers, layer_types=config.layer_types[:1] * layers,
                            mlp_types=config.mlp_types[:1] * layers)
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(jax.grad(lambda s: loss(nnx.merge(graphdef, s))))(state)
    return str(jaxpr).count("dot_general")


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_scanned_program_does_not_grow_with_depth(config):
    unrolled = [_dot_count(config, n) for n in (2, 4)]
    scanned = [_dot_count(config.replace(scan_layers=True), n) for n in (2, 4)]
    assert unrolled[1] > unrolled[0]  # each unrolled layer adds its matmuls
    assert scanned[0] == scanned[1]  # one block body


def test_the_decode_path_is_unchanged():
    """Decoding (a cache) runs the blocks one by one whatever scan_layers says."""
    unrolled, scanned = pair(DENSE)
    step = nnx.jit(lambda m: m.head(m(IDS, POSITIONS, SEGMENTS, cache=m.init_cache(2, 12)).hidden))
    np.testing.assert_array_equal(step(scanned), step(unrolled))


def test_mixed_layer_kinds_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="scan_layers needs every layer of one attention kind"):
        MOE.replace(mlp_types=("dense", "moe", "moe"), scan_layers=True)
    with pytest.raises(ValueError, match="scan_layers cannot scan lightning_attention layers"):
        DENSE.replace(layer_types=("lightning_attention",) * 3, qk_norm=False, scan_layers=True)
    with pytest.raises(ValueError, match="scan_layers must be true or false"):
        DENSE.replace(scan_layers="yes")


def test_matrices_stack_in_the_compute_dtype_and_the_gradients_stay_the_unrolled_ones():
    """float32 parameters, bfloat16 compute: the matrices every use casts to bfloat16 (projections,
    MLPs, experts) are stacked in it, half the stacked copy; norms and the router stay float32. The
    values are those the blocks cast anyway, so the gradients are the unrolled model's."""
    config = MOE.replace(dtype="bfloat16")
    unrolled, scanned = pair(config)
    _, stacked = stack_blocks(scanned.layers, config.compute_dtype)
    dtypes = {"/".join(str(getattr(key, "key", key)) for key in path): leaf.dtype
              for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(stacked))}
    compute = {name for name, dtype in dtypes.items() if dtype == jnp.bfloat16}
    assert compute == {f"{module}/{weight}" for module, weight in
                       [("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
                        ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
                        ("mlp/shared_expert", "gate_proj"), ("mlp/shared_expert", "up_proj"),
                        ("mlp/shared_expert", "down_proj")]}, dtypes
    assert all(dtypes[name] == jnp.float32 for name in dtypes if name not in compute)
    grad = nnx.jit(nnx.grad(loss))
    g1, g2 = grad(unrolled), grad(scanned)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-5)
