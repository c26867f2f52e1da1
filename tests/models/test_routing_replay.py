"""Rollout routing replay (R3) in the decoder: MoE layers given experts use them, with combine
weights from the current router, against a numpy reference of the routed SwiGLU sum; replaying
the model's own routes changes nothing; the router still gets gradients; expert parallelism
replays as one device does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, MeshConfig, ModelConfig, make_mesh, shard_model
from jaxrl.models.moe import MoE

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_types=("moe", "dense", "moe"), num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=16, tie_word_embeddings=False)
BATCH, LENGTH = 8, 8


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CONFIG.vocab_size, (BATCH, LENGTH)).astype(np.int32)
    positions = np.tile(np.arange(LENGTH, dtype=np.int32), (BATCH, 1))
    return ids, positions


def other_routes(seed=1):
    """Distinct experts per position, as an engine with another router might pick."""
    rng = np.random.default_rng(seed)
    k, layers = CONFIG.num_experts_per_tok, CONFIG.mlp_types.count("moe")
    return np.stack([rng.permutation(CONFIG.num_experts)[:k] for _ in range(BATCH * LENGTH * layers)]).reshape(
        BATCH, LENGTH, layers, k).astype(np.int32)


def silu(x):
    return x / (1.0 + np.exp(-x))


def numpy_moe(layer: MoE, x: np.ndarray, routes: np.ndarray) -> np.ndarray:
    """y_n = sum over the used experts e of w_e SwiGLU_e(x_n); w = the router's softmax of those
    experts (renormalised with norm_topk_prob); rows of -1 use the top-k. float64."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    gate, up, down = (np.asarray(p[...], np.float64) for p in (layer.gate_proj, layer.up_proj, layer.down_proj))
    logits = x @ np.asarray(layer.router[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    routes = routes.reshape(x.shape[0], -1)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        used = routes[n] if np.all(routes[n] >= 0) else np.argsort(-probs[n], kind="stable")[:routes.shape[1]]
        w = probs[n, used]
        if layer.config.norm_topk_prob:
            w = w / w.sum()
        for e, weight in zip(used, w, strict=True):
            out[n] += weight * ((silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e])
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_a_replayed_layer_is_the_routed_sum_of_the_given_experts(norm_topk_prob):
    layer = MoE(CONFIG.replace(norm_topk_prob=norm_topk_prob), rngs=nnx.Rngs(3))
    x = np.random.default_rng(2).normal(size=(BATCH, LENGTH, CONFIG.hidden_size)).astype(np.float32)
    routes = other_routes()[:, :, 0]
    routes[0, :3] = -1  # unrecorded positions (padding) route as usual
    y, _, experts = layer(jnp.asarray(x), jnp.asarray(routes))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, CONFIG.hidden_size), numpy_moe(layer, x, routes),
                               atol=2e-5, rtol=1e-4)
    _, _, own = layer(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(experts)[1:], routes[1:])
    np.testing.assert_array_equal(np.asarray(experts)[0, :3], np.asarray(own)[0, :3])


def test_routing_is_dropless_when_every_token_goes_to_the_same_experts():
    """The most unbalanced routing there is (every token's k assignments on experts 0..k-1, here
    by replay): no capacity, nothing dropped; the output is the float64 sum over those experts."""
    layer = MoE(CONFIG, rngs=nnx.Rngs(4))
    x = np.random.default_rng(5).normal(size=(BATCH, LENGTH, CONFIG.hidden_size)).astype(np.float32)
    routes = np.broadcast_to(np.arange(CONFIG.num_experts_per_tok, dtype=np.int32),
                             (BATCH, LENGTH, CONFIG.num_experts_per_tok)).copy()
    y, _, experts = layer(jnp.asarray(x), jnp.asarray(routes))
    np.testing.assert_array_equal(np.asarray(experts), routes)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, CONFIG.hidden_size), numpy_moe(layer, x, routes),
                               atol=2e-5, rtol=1e-4)


def test_replaying_the_models_own_routes_changes_nothing_and_other_routes_do():
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    ids, positions = inputs()
    out = model(ids, positions)
    own = model.head(model(ids, positions, routed_experts=out.routed_experts).hidden)
    np.testing.assert_array_equal(np.asarray(own), np.asarray(model.head(out.hidden)))
    replayed = model(ids, positions, routed_experts=other_routes())
    np.testing.assert_array_equal(np.asarray(replayed.routed_experts), other_routes())
    assert np.max(np.abs(np.asarray(model.head(replayed.hidden) - model.head(out.hidden)))) > 1e-3
    with pytest.raises(ValueError, match=r"routed_experts \(8, 8, 1, 2\) must be \[B, T, MoE layers, k\]"):
        model(ids, positions, routed_experts=other_routes()[:, :, :1])


def test_the_router_gets_gradients_under_replay():
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    ids, positions = inputs()
    routes = jnp.asarray(other_routes())

    def loss(m):
        return jnp.sum(m.head(m(ids, positions, routed_experts=routes).hidden) ** 2)

    grads = nnx.grad(loss)(model)
    for i in (0, 2):
        router = np.asarray(grads.layers[i].mlp.router[...])
        assert np.all(np.isfinite(router)) and np.abs(router).max() > 0, i


def test_replay_under_expert_parallelism_equals_one_device():
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    ids, positions = inputs()
    routes = other_routes()
    want = np.asarray(model.head(model(ids, positions, routed_experts=routes).hidden))
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    sharded, _ = shard_model(nnx.clone(model), mesh)
    with jax.set_mesh(mesh):
        forward = nnx.jit(lambda m, r: m.head(m(ids, positions, routed_experts=r).hidden))
        got = np.asarray(forward(sharded, routes))
        assert "reduce_scatter" in forward.lower(sharded, routes).as_text()  # the expert-parallel path ran
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
