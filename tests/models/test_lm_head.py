"""docs/models.md#chunked-lm-head: the chunked LM head's logprobs and entropy from hidden states
(value, gradient, memory).

References are numpy float64 closed forms and autodiff of the naive (full-logits)
computation.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.models.lm_head import sharded_token_logprobs_and_entropy, token_logprobs_and_entropy
from jaxrl.models.sharding import MeshConfig, make_mesh


def _np_log_softmax(z):
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _naive(hidden, lm_head, targets, bias=None):
    logits = jnp.einsum("btd,dv->btv", hidden, lm_head, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


@pytest.fixture(scope="module")
def head_inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    batch, length, dim, vocab = 2, 7, 8, 37  # 14 tokens, prime vocab
    hidden = 2.0 * jax.random.normal(keys[0], (batch, length, dim))
    lm_head = jax.random.normal(keys[1], (dim, vocab))
    bias = jax.random.normal(keys[2], (vocab,))
    targets = jax.random.randint(keys[3], (batch, length), 0, vocab)
    # Random cotangents so both outputs contribute to the gradient.
    g_logp = jax.random.normal(keys[4], (batch, length))
    g_entropy = jax.random.normal(keys[5], (batch, length))
    return hidden, lm_head, bias, targets, g_logp, g_entropy


def _values_and_grads(head, targets, g_logp, g_entropy):
    """jit(h, w, b) -> (logp, entropy, (d_hidden, d_lm_head, d_bias)) for cotangents (g_logp, g_entropy)."""
    def run(h, w, b):
        (logp, entropy), pullback = jax.vjp(lambda h, w, b: head(h, w, targets, b), h, w, b)
        return logp, entropy, pullback((g_logp, g_entropy))
    return jax.jit(run)


# Token chunks and vocab tiles that do / do not divide 14 tokens and a vocabulary of 37.
@pytest.mark.parametrize("chunk_size,vocab_chunk_size,with_bias",
                         [(3, 10, False), (5, None, True), (4, 36, True), (100, 8, False)])
def test_chunked_head_matches_naive_value_and_gradient(head_inputs, chunk_size, vocab_chunk_size, with_bias):
    hidden, lm_head, bias, targets, g_logp, g_entropy = head_inputs
    bias = bias if with_bias else jnp.zeros_like(bias)

    # Values against a float64 numpy closed form.
    logits = np.einsum("btd,dv->btv", np.float64(hidden), np.float64(lm_head)) + np.float64(bias)
    log_probs = _np_log_softmax(logits)
    want_logp = np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]
    want_entropy = -(np.exp(log_probs) * log_probs).sum(-1)

    def chunked(h, w, y, b):
        return token_logprobs_and_entropy(h, w, y, chunk_size=chunk_size,
                                          vocab_chunk_size=vocab_chunk_size, bias=b)

    logp, entropy, grads = _values_and_grads(chunked, targets, g_logp, g_entropy)(hidden, lm_head, bias)
    assert logp.dtype == jnp.float32 and entropy.dtype == jnp.float32
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)

    # Gradients w.r.t. hidden, lm_head and bias against autodiff of the naive computation.
    _, _, want = _values_and_grads(_naive, targets, g_logp, g_entropy)(hidden, lm_head, bias)
    for name, got, expected in zip(("hidden", "lm_head", "bias"), grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5, err_msg=name)


def test_chunked_head_without_bias_matches_naive_gradient(head_inputs):
    hidden, lm_head, _, targets, g_logp, g_entropy = head_inputs

    def loss(head):
        def f(h, w):
            logp, entropy = head(h, w)
            return jnp.sum(logp * g_logp) + jnp.sum(entropy * g_entropy)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    got = loss(lambda h, w: token_logprobs_and_entropy(h, w, targets, chunk_size=3, vocab_chunk_size=10))
    want = loss(lambda h, w: _naive(h, w, targets))
    for g, w in zip(got(hidden, lm_head), want(hidden, lm_head), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5)


def test_chunked_head_bfloat16_inputs_accumulate_in_float32(head_inputs):
    hidden, lm_head, _, targets, g_logp, g_entropy = head_inputs
    h16, w16 = hidden.astype(jnp.bfloat16), lm_head.astype(jnp.bfloat16)
    # Reference: the bf16 values promoted to float64 exactly.
    logits = np.einsum("btd,dv->btv", np.float64(h16.astype(jnp.float32)), np.float64(w16.astype(jnp.float32)))
    log_probs = _np_log_softmax(logits)
    want_logp = np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]
    logp, entropy = jax.jit(lambda h, w: token_logprobs_and_entropy(
        h, w, targets, chunk_size=4, vocab_chunk_size=16))(h16, w16)
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, -(np.exp(log_probs) * log_probs).sum(-1), rtol=1e-5, atol=1e-5)

    chunked = lambda h, w, y, b: token_logprobs_and_entropy(h, w, y, chunk_size=4, vocab_chunk_size=16)
    _, _, (d_h, d_w, _) = _values_and_grads(chunked, targets, g_logp, g_entropy)(h16, w16, None)
    assert d_h.dtype == jnp.bfloat16 and d_w.dtype == jnp.bfloat16
    naive = lambda h, w, y, b: _naive(h, w, y)
    _, _, (want_h, want_w, _) = _values_and_grads(naive, targets, g_logp, g_entropy)(
        h16.astype(jnp.float32), w16.astype(jnp.float32), None)
    # One bf16 rounding of the result: relative 2**-8.
    np.testing.assert_allclose(d_h.astype(jnp.float32), want_h, rtol=8e-3, atol=8e-3)
    np.testing.assert_allclose(d_w.astype(jnp.float32), want_w, rtol=8e-3, atol=8e-3)


def test_chunked_head_never_holds_full_logits():
    """Compiled forward+backward temporaries stay far below one [N, V] float32 array."""
    tokens, dim, vocab = 1024, 16, 4096
    full_logits_bytes = tokens * vocab * 4
    shapes = (jax.ShapeDtypeStruct((1, tokens, dim), jnp.float32),
              jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
              jax.ShapeDtypeStruct((1, tokens), jnp.int32))

    def temp_bytes(head):
        def loss(h, w, y):
            logp, ent = head(h, w, y)
            return jnp.sum(logp) + jnp.sum(ent)
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(lambda h, w, y: token_logprobs_and_entropy(h, w, y, chunk_size=128, vocab_chunk_size=512))
    naive = temp_bytes(_naive)
    assert naive >= full_logits_bytes  # the reference does hold it
    assert chunked < full_logits_bytes / 4, (chunked, full_logits_bytes)


@pytest.mark.parametrize("mesh_shape, dim", [({"data": 2, "fsdp": 4}, 16), ({"fsdp": 8}, 16),
                                             ({"fsdp": 2, "tensor": 4}, 16), ({"sequence": 8}, 16),
                                             ({"data": 2, "sequence": 4}, 16), ({"fsdp": 8}, 12)])
def test_on_a_mesh_each_device_runs_the_head_on_its_own_tokens(mesh_shape, dim):
    """Left to XLA's partitioner, the token-chunk loop indexes a sharded axis: every device gathers
    the whole batch's hidden states and runs the head on all of it. The sharded head gathers no
    hidden state, whether the rows or a row's tokens (``sequence``) are split: each device loops
    over its own chunks; the only gathers are of one vocabulary tile of the head (forward, and
    again backward), and the head's gradient leaves each tile as one reduce-scatter, so no device
    holds the whole head or its gradient. When the devices do not divide the hidden size (12 over
    8), each holds the head whole and nothing is gathered. Values and gradients equal one device's."""
    batch, length, vocab = 8, 64, 300
    keys = jax.random.split(jax.random.key(1), 4)
    hidden = jax.random.normal(keys[0], (batch, length, dim))
    lm_head = jax.random.normal(keys[1], (dim, vocab))
    bias = jax.random.normal(keys[2], (vocab,))
    targets = jax.random.randint(keys[3], (batch, length), 0, vocab)
    weights = jnp.arange(batch * length, dtype=jnp.float32).reshape(batch, length) / (batch * length)

    def gradient(head):
        def loss(h, w, b):
            logp, entropy = head(h, w, targets, chunk_size=16, vocab_chunk_size=128, bias=b)
            return jnp.sum(logp * weights) + jnp.sum(entropy ** 2), (logp, entropy)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    want = gradient(token_logprobs_and_entropy)(hidden, lm_head, bias)
    mesh = make_mesh(MeshConfig(**mesh_shape))
    token_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"), "sequence"))
    on_mesh = (jax.device_put(hidden, NamedSharding(mesh, PartitionSpec(*token_sharding.spec, None))), lm_head, bias)
    collectives = {}
    with jax.set_mesh(mesh):
        got = gradient(sharded_token_logprobs_and_entropy)(*on_mesh)
        for name, head in (("sharded", sharded_token_logprobs_and_entropy),
                           ("partitioner", token_logprobs_and_entropy)):
            text = gradient(head).lower(*on_mesh).compile().as_text()
            collectives[name] = re.findall(r"= (\S+?)(?:\{[\d,]*\})? (all-gather|reduce-scatter)(?:-start)?\(", text)
    for expected, actual in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
    tile, token_devices = f"f32[{dim},128]", mesh.size // mesh.shape["tensor"]
    split_head = [(tile, "all-gather")] * 2 + [(f"f32[{dim // token_devices},128]", "reduce-scatter")]
    assert sorted(collectives["sharded"]) == (split_head if dim % token_devices == 0 else []), collectives
    assert any(shape != tile for shape, op in collectives["partitioner"] if op == "all-gather"), collectives


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 8}, {"sequence": 8}])
def test_bfloat16_compute_keeps_the_heads_gradient_in_float32(mesh_shape):
    """``compute_dtype``: the matmuls take bfloat16 tiles, but the float32 head's gradient is never
    rounded to bfloat16, on one device or on each device before the devices' sum (rounded, eight
    partials gave a gradient that depends on which tokens each device holds). The rows, or a row's
    tokens, are split over 8 devices and the gradient equals one device's to float32 summation
    order."""
    batch, length, dim, vocab = 8, 32, 16, 300
    keys = jax.random.split(jax.random.key(2), 3)
    hidden = jax.random.normal(keys[0], (batch, length, dim)).astype(jnp.bfloat16)
    lm_head = jax.random.normal(keys[1], (dim, vocab))
    targets = jax.random.randint(keys[2], (batch, length), 0, vocab)

    def head_gradient(h, w):
        logp, entropy = sharded_token_logprobs_and_entropy(h, w, targets, compute_dtype=jnp.bfloat16,
                                                           chunk_size=16, vocab_chunk_size=128)
        return jnp.sum(logp) + jnp.sum(entropy)

    want = jax.jit(jax.grad(head_gradient, argnums=1))(hidden, lm_head)  # no mesh: one device
    mesh = make_mesh(MeshConfig(**mesh_shape))
    with jax.set_mesh(mesh):
        split = jax.device_put(hidden, NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "sequence")))
        got = jax.jit(jax.grad(head_gradient, argnums=1))(split, lm_head)
    assert want.dtype == got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_bad_input_names_the_argument():
    h, w, y = jnp.zeros((2, 3, 4)), jnp.zeros((4, 5)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="lm_head"):
        token_logprobs_and_entropy(h, jnp.zeros((5, 4)), y)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_and_entropy(h, w, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_and_entropy(h, w, jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="hidden"):
        token_logprobs_and_entropy(jnp.zeros((6, 4)), w, y)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_and_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        token_logprobs_and_entropy(h, w, y, vocab_chunk_size=-2)
    with pytest.raises(ValueError, match="bias"):
        token_logprobs_and_entropy(h, w, y, bias=jnp.zeros(4))
