"""Linear-attention kernels and layers against references written from the equations and against
the transformers PyTorch modules (MiniMaxLightningAttention, Qwen3NextGatedDeltaNet,
Qwen3NextAttention), all float32 on CPU.

Tolerance: 1e-5 absolute and relative in float32 on O(1) activations, unless a test says why not.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl.models import linear_attention as la
from jaxrl.models import linear_layers as ll

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def no_mesh():
    """Layers carry logical axis names; without a mesh they are created unsharded."""
    with nnx.use_eager_sharding(False):
        yield


# ---------------------------------------------------------------- references from the equations
def naive_lightning(xp, q, k, v, log_decay):
    """Quadratic form: o_t = sum_{s<=t} lambda^(t-s) (q_t . k_s) v_s, state S_T = sum_s lambda^(T-1-s) k_s^T v_s."""
    length = q.shape[1]
    t = np.arange(length)
    gap = (t[:, None] - t[None, :]).astype(np.float64)
    lower = gap >= 0
    decay = xp.exp(xp.where(lower[None], gap[None] * log_decay[:, None, None], -np.inf))  # [H, T, S]
    scores = xp.einsum("bthd,bshd->bhts", q, k) * decay[None]
    out = xp.einsum("bhts,bshv->bthv", scores, v)
    last = xp.exp(log_decay[None, :] * (length - 1 - t)[:, None])  # [S, H]
    state = xp.einsum("bshk,bshv->bhkv", k * last[None, :, :, None], v)
    return out, state


def naive_delta(xp, q, k, v, g, beta, state=None):
    """Token loop: S = e^g S; S += k^T beta (v - k S); o = q S."""
    batch, length, heads, dk = q.shape
    if state is None:
        state = xp.zeros((batch, heads, dk, v.shape[-1]))
    outs = []
    for t in range(length):
        state = state * xp.exp(g[:, t])[..., None, None]
        delta = beta[:, t][..., None] * (v[:, t] - xp.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + xp.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(xp.einsum("bhk,bhkv->bhv", q[:, t], state))
    return xp.stack(outs, axis=1), state


def random_inputs(seed, batch=2, length=11, heads=3, dk=4, dv=5):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, batch, length, heads, dk)).astype(np.float32)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule is stable for |k| <= 1
    v = rng.normal(size=(batch, length, heads, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, size=(batch, length, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(batch, length, heads)).astype(np.float32)
    log_decay = -rng.uniform(0.01, 1.0, size=(heads,)).astype(np.float32)
    state = rng.normal(size=(batch, heads, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, log_decay, state


lightning = jax.jit(la.lightning_attention, static_argnames="chunk_size")
delta_rule = jax.jit(la.gated_delta_rule, static_argnames="chunk_size")


@nnx.jit
def forward(layer, x, state=None):
    return layer(x, state)


@nnx.jit
def decode(layer, x, state):
    return layer.decode(x, state)


def f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


# ---------------------------------------------------------------- kernels
@pytest.mark.parametrize("chunk_size", [1, 4, 16])  # T=11: divides, does not, one padded chunk
def test_lightning_chunked_matches_quadratic_reference(chunk_size):
    q, k, v, _, _, log_decay, _ = random_inputs(0)
    out, state = lightning(q, k, v, log_decay, chunk_size=chunk_size)
    ref_out, ref_state = naive_lightning(np, *f64(q, k, v, log_decay))
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(state, ref_state, **TOL)
    assert state.dtype == jnp.float32


@pytest.mark.parametrize("chunk_size", [4, 11, 16])
def test_delta_chunked_matches_loop_reference(chunk_size):
    q, k, v, g, beta, _, state0 = random_inputs(1)
    out, state = delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state0)
    ref_out, ref_state = naive_delta(np, *f64(q, k, v, g, beta, state0))
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(state, ref_state, **TOL)


def test_lightning_initial_state_continues_the_sequence():
    q, k, v, _, _, log_decay, _ = random_inputs(2, length=12)
    full, full_state = lightning(q, k, v, log_decay, chunk_size=4)
    first, mid_state = lightning(q[:, :7], k[:, :7], v[:, :7], log_decay, chunk_size=3)
    second, end_state = lightning(
        q[:, 7:], k[:, 7:], v[:, 7:], log_decay, chunk_size=3, initial_state=mid_state
    )
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), full, **TOL)
    np.testing.assert_allclose(end_state, full_state, **TOL)


@pytest.mark.parametrize("chunk_size", [3, 4])  # T=12: divides and does not divide
def test_chunked_equals_recurrent_token_by_token(chunk_size):
    q, k, v, g, beta, log_decay, state0 = random_inputs(3, length=12)
    chunk_l, state_l = lightning(q, k, v, log_decay, chunk_size=chunk_size, initial_state=state0)
    chunk_d, state_d = delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state0)
    step_l, step_d = jax.jit(la.lightning_attention_step), jax.jit(la.gated_delta_rule_step)
    rec_l, rec_d = jnp.asarray(state0), jnp.asarray(state0)
    for t in range(q.shape[1]):
        out_l, rec_l = step_l(q[:, t], k[:, t], v[:, t], log_decay, rec_l)
        out_d, rec_d = step_d(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], rec_d)
        np.testing.assert_allclose(out_l, chunk_l[:, t], **TOL)
        np.testing.assert_allclose(out_d, chunk_d[:, t], **TOL)
    np.testing.assert_allclose(rec_l, state_l, **TOL)
    np.testing.assert_allclose(rec_d, state_d, **TOL)


def test_gradients_of_chunked_forms_match_naive_references():
    """d(sum(o * w) + sum(S * u))/d(every input) from the chunked kernels vs jax.grad of the naive forms."""
    q, k, v, g, beta, log_decay, state0 = random_inputs(4, length=7)
    rng = np.random.default_rng(5)
    w_out = rng.normal(size=v.shape).astype(np.float32)
    w_state = rng.normal(size=state0.shape).astype(np.float32)

    def objective(fn):
        def loss(*xs):
            out, state = fn(*xs)
            return jnp.sum(out * w_out) + jnp.sum(state * w_state)

        return loss

    cases = [
        (
            objective(lambda q, k, v, d: la.lightning_attention(q, k, v, d, chunk_size=3)),
            objective(lambda q, k, v, d: naive_lightning(jnp, q, k, v, d)),
            (q, k, v, log_decay),
        ),
        (
            objective(lambda *xs: la.gated_delta_rule(*xs[:5], chunk_size=3, initial_state=xs[5])),
            objective(lambda *xs: naive_delta(jnp, *xs)),
            (q, k, v, g, beta, state0),
        ),
    ]
    for fn, ref, args in cases:
        argnums = tuple(range(len(args)))
        got, want = jax.jit(jax.grad(fn, argnums))(*args), jax.jit(jax.grad(ref, argnums))(*args)
        for a, b in zip(got, want):
            # a loss of ~1e2 summed over many terms: gradients agree to f32 rounding of that sum
            np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-5)


def test_state_is_float32_for_bfloat16_inputs():
    q, k, v, g, beta, log_decay, _ = random_inputs(6)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out, state = delta_rule(q, k, v, g, beta, chunk_size=4)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    _, state = la.lightning_attention_step(q[:, 0], k[:, 0], v[:, 0], log_decay, state)
    assert state.dtype == jnp.float32


def test_bad_chunk_size_and_state_shape_are_named():
    q, k, v, g, beta, log_decay, state0 = random_inputs(7)
    for bad in (0, -3, 2.0):
        with pytest.raises(ValueError, match="chunk_size"):
            la.lightning_attention(q, k, v, log_decay, chunk_size=bad)
    with pytest.raises(ValueError, match="chunk_size=0"):
        la.gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match=r"state has shape \(2, 3, 5, 4\)"):
        la.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state0.transpose(0, 1, 3, 2))
    with pytest.raises(ValueError, match="initial_state"):
        la.lightning_attention(q, k, v, log_decay, initial_state=state0[:1])
    with pytest.raises(ValueError, match="chunk_size=0"):
        ll.LightningAttention(8, 2, 4, layer_idx=0, num_layers=2, chunk_size=0, rngs=nnx.Rngs(0))


# ---------------------------------------------------------------- layers vs transformers
def randomize_(module, seed):
    """Give every torch parameter O(1)-output random values (the default init makes outputs ~1e-3)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = p.shape[-1] if p.ndim == 2 else 1
            p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in) * (0.3 if p.ndim == 1 else 1.0))
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 2 + 0.1))


def load_from_torch(layer, module):
    """Copy torch weights into a layer: [out, in] Linear weights transpose to [in, out]."""
    for name, p in module.named_parameters():
        ours = name.replace(".weight", "")
        value = p.detach().numpy()
        if value.ndim == 3:  # depthwise conv [C, 1, K] -> [K, C]
            value = value[:, 0, :].T
        elif value.ndim == 2:
            value = value.T
        getattr(layer, ours)[...] = jnp.asarray(value)


def torch_input(seed, batch, length, hidden):
    return torch.randn(batch, length, hidden, generator=torch.Generator().manual_seed(seed))


def minimax_config(**kw):
    from transformers import MiniMaxConfig

    return MiniMaxConfig(
        hidden_size=32, num_attention_heads=4, head_dim=8, num_hidden_layers=4, block_size=5,
        layer_types=["linear_attention"] * 3 + ["full_attention"], **kw,
    )


def qwen3_next_config():
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_conv_kernel_dim=4, num_hidden_layers=4, rms_norm_eps=1e-6,
    )
    config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("layer_idx", [0, 2])
def test_lightning_layer_matches_minimax(layer_idx):
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = minimax_config()
    ref = MiniMaxLightningAttention(config, layer_idx).eval()
    randomize_(ref, layer_idx)
    layer = ll.LightningAttention(32, 4, 8, layer_idx=layer_idx, num_layers=4, chunk_size=5, rngs=nnx.Rngs(0))
    load_from_torch(layer, ref)
    x = torch_input(10, 2, 13, 32)  # block 5 does not divide 13: the reference pads its last block too
    with torch.no_grad():
        want, want_state = ref(x, None, None)
    got, state = forward(layer, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(got, want.numpy(), **TOL)
    np.testing.assert_allclose(state, want_state.numpy(), **TOL)


def test_delta_layer_matches_qwen3_next():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    ref = Qwen3NextGatedDeltaNet(qwen3_next_config(), 0).eval()
    randomize_(ref, 1)
    layer = ll.GatedDeltaNet(32, 2, 4, 8, 6, conv_kernel_size=4, chunk_size=4, rngs=nnx.Rngs(0))
    load_from_torch(layer, ref)
    x = torch_input(11, 2, 10, 32)
    with torch.no_grad():
        want = ref(x)
    got, _ = forward(layer, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(got, want.numpy(), **TOL)


def test_gated_attention_matches_qwen3_next():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

    config = qwen3_next_config()
    ref = Qwen3NextAttention(config, 3).eval()
    randomize_(ref, 2)
    layer = ll.GatedAttention(
        32, 4, 2, 8, rope_theta=config.rope_parameters["rope_theta"],
        partial_rotary_factor=config.rope_parameters["partial_rotary_factor"], rngs=nnx.Rngs(0),
    )
    load_from_torch(layer, ref)
    batch, length = 2, 9
    x = torch_input(12, batch, length, 32)
    positions = torch.arange(length)[None].expand(batch, length)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None].expand(batch, 1, length, length)
    with torch.no_grad():
        want, _ = ref(x, Qwen3NextRotaryEmbedding(config)(x, positions), mask)
    got, _ = forward(layer, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(got, want.numpy(), **TOL)


# ---------------------------------------------------------------- prefill + decode == full forward
def make_layers():
    rngs = nnx.Rngs(3)
    return {
        "lightning": ll.LightningAttention(32, 4, 8, layer_idx=1, num_layers=4, chunk_size=4, rngs=rngs),
        "delta": ll.GatedDeltaNet(32, 2, 4, 8, 6, chunk_size=3, rngs=rngs),
        "attention": ll.GatedAttention(32, 4, 2, 8, rngs=rngs),
    }


@pytest.mark.parametrize("kind", ["lightning", "delta", "attention"])
def test_prefill_then_decode_equals_full_forward(kind):
    layer = make_layers()[kind]
    for p in jax.tree.leaves(nnx.state(layer, nnx.Param)):
        assert p.dtype == jnp.float32
    prompt, new = 7, 4
    x = jnp.asarray(np.random.default_rng(8).normal(size=(2, prompt + new, 32)), jnp.float32)
    full, _ = forward(layer, x)
    state = layer.init_state(2, prompt + new) if kind == "attention" else None
    prefix, state = forward(layer, x[:, :prompt], state)
    outputs = [prefix]
    for t in range(prompt, prompt + new):
        y, state = decode(layer, x[:, t : t + 1], state)
        outputs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), full, **TOL)


def test_decode_with_wrong_state_shape_names_it():
    layers = make_layers()
    x = jnp.ones((2, 1, 32))
    with pytest.raises(ValueError, match="state has shape"):
        decode(layers["lightning"], x, jnp.zeros((2, 4, 8, 7)))
    good = layers["delta"].init_state(2)
    with pytest.raises(ValueError, match="state.conv"):
        decode(layers["delta"], x, good._replace(conv=good.conv[:, :1]))
    with pytest.raises(ValueError, match="state has shape"):
        decode(layers["delta"], x, good._replace(recurrent=good.recurrent[:1]))
    with pytest.raises(ValueError, match="one token"):
        layers["lightning"].decode(jnp.ones((2, 3, 32)), layers["lightning"].init_state(2))
