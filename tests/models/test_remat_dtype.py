"""Rematerialisation policies change memory, not numbers; bfloat16 compute keeps a float32 residual."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, MeshConfig, ModelConfig, create_sharded_model, make_mesh

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8)  # dense: the MoE block goes through the same Block remat wrapper
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))


@pytest.fixture(scope="module")
def state():
    model, _ = create_sharded_model(lambda: Decoder(CONFIG, rngs=nnx.Rngs(0)), make_mesh(MeshConfig()))
    return nnx.state(model)


def with_config(state, config):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, state)


def loss(model):
    out = model(IDS, POSITIONS)
    logp = jax.nn.log_softmax(model.head(out.hidden))
    return -jnp.mean(jnp.take_along_axis(logp, jnp.roll(IDS, -1, axis=1)[..., None], axis=-1))


@pytest.fixture(scope="module")
def reference_grads(state):
    return jax.tree.leaves(nnx.jit(nnx.grad(loss))(with_config(state, CONFIG)))


@pytest.mark.parametrize("policy", ["full", "save_attention_out"])
def test_remat_policies_give_the_same_gradients(state, reference_grads, policy):
    model = with_config(state, CONFIG.replace(remat=policy))
    grads = jax.tree.leaves(nnx.jit(nnx.grad(loss))(model))
    for want, got in zip(reference_grads, grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("policy", ["none", "full", "save_dots", "save_attention_out"])
def test_remat_policy_wraps_each_block(state, policy):
    model = with_config(state, CONFIG.replace(remat=policy))
    jaxpr = str(jax.make_jaxpr(lambda s: loss(nnx.merge(nnx.graphdef(model), s)))(nnx.state(model)))
    assert jaxpr.count("remat2[") == (0 if policy == "none" else CONFIG.num_layers)


def test_bfloat16_compute_keeps_float32_residual_and_head(state):
    f32 = with_config(state, CONFIG)
    bf16 = with_config(state, CONFIG.replace(dtype="bfloat16"))
    run = nnx.jit(lambda m: (m(IDS, POSITIONS, capture=True), m.logits(IDS, POSITIONS)))
    (_, logits32), (out16, logits16) = run(f32), run(bf16)
    for name in ("embed", "layers.1.out", "final_norm"):
        assert out16.activations[name].dtype == jnp.float32, name
    assert logits16.dtype == jnp.float32
    scale = float(jnp.abs(logits32).max())
    error = float(jnp.abs(logits16 - logits32).max())
    assert 0 < error < 0.05 * scale  # bfloat16 matmul inputs: visibly different, still close


def test_bfloat16_parameters():
    model = nnx.eval_shape(lambda: Decoder(CONFIG.replace(param_dtype="bfloat16"), rngs=nnx.Rngs(0)))
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
