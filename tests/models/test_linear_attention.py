"""Linear-attention kernels, layers and hybrid models against references written from the
equations and against transformers' PyTorch modules and models (MiniMaxLightningAttention,
Qwen3NextGatedDeltaNet, Qwen3NextAttention, MiniMaxForCausalLM, Qwen3NextForCausalLM), all
float32 on CPU.

Tolerance: 1e-5 absolute and relative in float32 on O(1) activations, unless a test says why not.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.models import MeshConfig, ModelConfig, load_hf_checkpoint, make_mesh, save_hf_checkpoint, shard_model
from jaxrl.models import linear_attention as la
from jaxrl.models import linear_layers as ll
from jaxrl.models.layers import Attention

pytestmark = pytest.mark.fully_optimised  # compared with transformers at float32 rounding (conftest.py)

TOL = dict(atol=1e-5, rtol=1e-5)


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
    return layer(x, cache=state)


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
        for a, b in zip(got, want, strict=True):
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
    with pytest.raises(ValueError, match=r"log_decay has shape \(3, 1\), expected \(3,\)"):
        la.lightning_attention(q, k, v, log_decay[:, None])
    with pytest.raises(ValueError, match=r"beta has shape \(2, \d+, 1\), expected \(2, \d+, 3\)"):
        la.gated_delta_rule(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="linear_chunk_size"):
        tiny_config(linear_chunk_size=0)



# ---------------------------------------------------------------- layers vs transformers
def tiny_config(**overrides):
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_chunk_size=4,
                  layer_types=("lightning_attention", "gated_deltanet", "lightning_attention", "full_attention"))
    fields.update(overrides)
    return ModelConfig(**fields)


def randomize_(module, seed):
    """O(1)-output random torch weights (the default init makes outputs ~1e-3): matrices ~ 1/sqrt(fan_in),
    norm scales ~ 1 + 0.3 N(0, 1) (Qwen3-Next's offset norms store scale - 1), other vectors ~ 0.3 N(0, 1),
    A_log = log(U(0.1, 2.1))."""
    gen = torch.Generator().manual_seed(seed)
    offset_norms = getattr(module, "config", None) is not None and module.config.model_type == "qwen3_next"
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 2 + 0.1))
            elif p.ndim == 1:
                scale = "norm" in name and not (offset_norms and "linear_attn" not in name)
                p.copy_((1.0 if scale else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
    return module


def load_from_torch(layer, module):
    """Copy torch weights into a layer: [out, in] Linear weights transpose to [in, out], then reshape."""
    for name, p in module.named_parameters():
        value = p.detach().numpy()
        if value.ndim == 3:  # depthwise conv [C, 1, K] -> [K, C]
            value = value[:, 0, :].T
        elif value.ndim == 2:
            value = value.T
        target = getattr(layer, name.split(".")[0])
        if isinstance(target, nnx.Module):
            target = target.weight
        target[...] = jnp.asarray(value.reshape(target.shape))


def torch_input(seed, batch, length, hidden):
    return torch.randn(batch, length, hidden, generator=torch.Generator().manual_seed(seed))


def minimax_hf_config(**overrides):
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_hidden_layers=4, block_size=5, num_local_experts=4, num_experts_per_tok=2,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    fields.update(overrides)
    config = transformers.MiniMaxConfig(**fields)
    config._attn_implementation = "eager"
    return config


def qwen3_next_hf_config(**overrides):
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=4, rms_norm_eps=1e-6,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                  mlp_only_layers=[1], layer_types=["linear_attention", "linear_attention", "full_attention",
                                                    "linear_attention"])
    fields.update(overrides)
    config = transformers.Qwen3NextConfig(**fields)
    config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("layer_idx", [2])  # depth-scaled slopes; the model tests cover layers 0, 1, 3
def test_lightning_layer_matches_minimax(layer_idx):
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    ref = randomize_(MiniMaxLightningAttention(minimax_hf_config(), layer_idx).eval(), layer_idx)
    layer = ll.LightningAttention(tiny_config(linear_chunk_size=5), rngs=nnx.Rngs(0), layer_index=layer_idx)
    load_from_torch(layer, ref)
    x = torch_input(10, 2, 13, 32)  # block 5 does not divide 13: the reference pads its last block too
    with torch.no_grad():
        want, want_state = ref(x, None, None)
    got, state = forward(layer, jnp.asarray(x.numpy()), layer.init_cache(2))
    np.testing.assert_allclose(got, want.numpy(), **TOL)
    np.testing.assert_allclose(state, want_state.numpy(), **TOL)


def test_delta_layer_matches_qwen3_next():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    ref = randomize_(Qwen3NextGatedDeltaNet(qwen3_next_hf_config(), 0).eval(), 1)
    layer = ll.GatedDeltaNet(tiny_config(linear_chunk_size=3), rngs=nnx.Rngs(0))
    load_from_torch(layer, ref)
    x = torch_input(11, 2, 10, 32)
    with torch.no_grad():
        want = ref(x)
    got, _ = forward(layer, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(got, want.numpy(), **TOL)


def test_gated_attention_matches_qwen3_next():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

    hf_config = qwen3_next_hf_config()
    ref = randomize_(Qwen3NextAttention(hf_config, 2).eval(), 2)
    config = ModelConfig.from_hf(hf_config.to_dict())
    assert config.attention_output_gate and config.norm_weight_offset and config.partial_rotary_factor == 0.25
    layer = Attention(config, rngs=nnx.Rngs(0))
    load_from_torch(layer, ref)
    batch, length = 2, 9
    x = torch_input(12, batch, length, 32)
    positions = torch.arange(length)[None].expand(batch, length)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None].expand(batch, 1, length, length)
    with torch.no_grad():
        want, _ = ref(x, Qwen3NextRotaryEmbedding(hf_config)(x, positions), mask)
    got, _ = nnx.jit(lambda layer, x, p: layer(x, positions=p, segment_ids=jnp.ones_like(p)))(
        layer, jnp.asarray(x.numpy()), jnp.asarray(positions.numpy()))
    np.testing.assert_allclose(got, want.numpy(), **TOL)


@pytest.mark.parametrize("kind", ["lightning_attention", "gated_deltanet"])
def test_layer_prefill_then_decode_equals_full_forward(kind):
    layer = ll.LightningAttention if kind == "lightning_attention" else ll.GatedDeltaNet
    layer = layer(tiny_config(), rngs=nnx.Rngs(3), layer_index=1)
    for p in jax.tree.leaves(nnx.state(layer, nnx.Param)):
        assert p.dtype == jnp.float32
    prompt, new = 7, 4
    x = jnp.asarray(np.random.default_rng(8).normal(size=(2, prompt + new, 32)), jnp.float32)
    full, _ = forward(layer, x)
    prefix, state = forward(layer, x[:, :prompt], layer.init_cache(2))
    outputs = [prefix]
    for t in range(prompt, prompt + new):
        y, state = forward(layer, x[:, t : t + 1], state)
        outputs.append(y)
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(state))
    np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), full, **TOL)


def test_decode_with_wrong_state_shape_names_it():
    config = tiny_config()
    lightning = ll.LightningAttention(config, rngs=nnx.Rngs(0), layer_index=0)
    delta = ll.GatedDeltaNet(config, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 1, 32))
    with pytest.raises(ValueError, match="state has shape"):
        forward(lightning, x, jnp.zeros((2, 4, 8, 7)))
    good = delta.init_cache(2)
    with pytest.raises(ValueError, match="cache.conv"):
        forward(delta, x, good._replace(conv=good.conv[:, :1]))
    with pytest.raises(ValueError, match="state has shape"):
        forward(delta, x, good._replace(recurrent=good.recurrent[:1]))


def test_layer_pattern_repeats_and_names_unknown_types():
    from jaxrl.models.config import layer_pattern

    types = layer_pattern("lightning_attention*7, full_attention", 16)
    assert types == (("lightning_attention",) * 7 + ("full_attention",)) * 2
    assert tiny_config(num_layers=16, layer_types=types).layer_types == types
    with pytest.raises(ValueError, match="unknown layer type 'linear'"):
        layer_pattern("linear*7,full_attention", 8)
    with pytest.raises(ValueError, match="repeat count '0'"):
        layer_pattern("gated_deltanet*0,full_attention", 8)


def test_unknown_layer_type_is_named():
    with pytest.raises(ValueError, match=r"layer_types\[1\] = 'mamba'"):
        tiny_config(layer_types=("lightning_attention", "mamba", "full_attention", "full_attention"))
    hf = minimax_hf_config().to_dict()
    hf["layer_types"][3] = "sliding_attention"
    with pytest.raises(ValueError, match=r"layer_types\[3\] = 'sliding_attention'"):
        ModelConfig.from_hf(hf)


# ---------------------------------------------------------------- hybrid models
FAMILIES = {
    "minimax": (minimax_hf_config, transformers.MiniMaxForCausalLM),
    "qwen3_next": (qwen3_next_hf_config, transformers.Qwen3NextForCausalLM),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, torch reference, folder it saved, our model loaded from that folder)."""
    make_config, cls = FAMILIES[request.param]
    reference = randomize_(cls(make_config()).eval(), 7)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    return request.param, reference, folder, load_hf_checkpoint(str(folder))


@nnx.jit
def logits_of(model, ids):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return model.head(model(ids, positions).hidden)


@nnx.jit
def decode_step(model, ids, positions, cache):
    out = model(ids, positions, cache=cache)
    return model.head(out.hidden), out.cache


IDS = np.random.default_rng(9).integers(0, 64, size=(2, 11))


@pytest.fixture(scope="module")
def float32_gap(family):
    """Largest |float32 - float64| logit of transformers' own forward on IDS: how precisely float32 can
    compute this model at all. Tolerances below are max(1e-5, twice this)."""
    name, reference, folder, _ = family
    exact = type(reference).from_pretrained(folder, dtype=torch.float64, experts_implementation="eager",
                                            attn_implementation="eager").eval()
    with torch.no_grad():
        rounded, truth = (m(input_ids=torch.tensor(IDS)).logits.numpy() for m in (reference, exact))
    return float(np.abs(rounded - truth).max()), truth


def test_hybrid_logits_match_transformers(family, float32_gap):
    """MiniMax: within 1e-5 of transformers' float32 forward (whose own float32 error is ~1e-6 here).
    Qwen3-Next: transformers' float32 forward is ~3e-5 off its float64 forward on this config (the
    delta rule's chunk-wise triangular solve amplifies rounding; with softmax layers only the gap is
    ~3e-6), so ours is held to the float64 forward, no further from it than twice that gap."""
    name, reference, _, model = family
    gap, truth = float32_gap
    got = np.asarray(logits_of(model, jnp.asarray(IDS)))
    with torch.no_grad():
        want = reference(input_ids=torch.tensor(IDS)).logits.numpy()
    if name == "minimax":
        assert gap < 1e-5
        np.testing.assert_allclose(got, want, **TOL)
    else:
        assert np.abs(got - truth).max() <= max(TOL["atol"], 2 * gap), (np.abs(got - truth).max(), gap)


def test_hybrid_prefill_then_decode_equals_full_forward(family, float32_gap):
    """Same logits within max(1e-5, twice the model's float32 gap): the chunked and recurrent forms
    round differently, by no more than float32 can resolve this model."""
    _, _, _, model = family
    prompt = 7
    full = np.asarray(logits_of(model, jnp.asarray(IDS)))
    positions = np.broadcast_to(np.arange(IDS.shape[1]), IDS.shape)
    cache = model.init_cache(2, IDS.shape[1])
    pieces = []
    for start, stop in [(0, prompt)] + [(t, t + 1) for t in range(prompt, IDS.shape[1])]:
        logits, cache = decode_step(model, jnp.asarray(IDS[:, start:stop]), jnp.asarray(positions[:, start:stop]),
                                    cache)
        pieces.append(np.asarray(logits))
    tolerance = max(TOL["atol"], 2 * float32_gap[0])
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=tolerance, rtol=TOL["rtol"])


def test_hybrid_checkpoint_round_trip(family, tmp_path):
    """HF files -> ours -> files: every parameter bit-identical to transformers' own save; the decay
    buffers MiniMax also stores are recomputed (float32 exp may differ from torch's in the last ulp);
    our save -> load -> save is bit-identical throughout; transformers reloads our files."""
    from safetensors.numpy import load_file

    name, reference, folder, model = family
    save_hf_checkpoint(model, str(tmp_path / "a"))
    save_hf_checkpoint(load_hf_checkpoint(str(tmp_path / "a")), str(tmp_path / "b"))
    original, first, second = (load_file(str(f / "model.safetensors"))
                               for f in (folder, tmp_path / "a", tmp_path / "b"))
    assert sorted(original) == sorted(first) == sorted(second)
    for key in original:
        assert first[key].tobytes() == second[key].tobytes(), key
        if key.endswith(("_decay", "slope_rate")):
            np.testing.assert_allclose(first[key], original[key], rtol=1e-6, atol=0, err_msg=key)
        else:
            assert first[key].dtype == original[key].dtype and first[key].tobytes() == original[key].tobytes(), key
    assert json.loads((tmp_path / "a" / "config.json").read_text())["architectures"] == reference.config.architectures
    # Both loaded the same way: torch's CPU kernels can round differently for a model built in memory
    # than for the same weights loaded from files (2.5e-7 apart for Qwen3-Next on one machine).
    reloaded, original_reloaded = (type(reference).from_pretrained(f, attn_implementation="eager").eval()
                                   for f in (tmp_path / "a", folder))
    with torch.no_grad():
        got, want = (m(input_ids=torch.tensor(IDS)).logits.numpy() for m in (reloaded, original_reloaded))
    if name == "minimax":  # it runs on our recomputed decay tables
        np.testing.assert_allclose(got, want, **TOL)
    else:
        np.testing.assert_array_equal(got, want)


def test_hybrid_in_memory_push_hands_over_the_checkpoint_tensors(family):
    """The in-memory SGLang push's buffers (host views of the parameters, the depthwise conv's
    [K, C] -> [C, 1, K] included, copied once each) hold transformers' own saved tensors: bit for bit,
    MiniMax's recomputed decay tables to float32 rounding as in the round trip above."""
    from safetensors.numpy import load_file

    from jaxrl.models.hf import hf_tensor_stream
    from jaxrl.rollout.sglang.tensors import SharedTensors, read_payload

    _, _, folder, model = family
    original = load_file(str(folder / "model.safetensors"))
    shared = SharedTensors()
    (names, last), = shared.chunks(hf_tensor_stream(model), chunk_bytes=2**40)  # one chunk
    assert last
    handed = read_payload(shared.payload(names))
    assert sorted(handed) == sorted(original)
    for key, want in original.items():
        assert handed[key].dtype == want.dtype and handed[key].shape == want.shape, key
        if key.endswith(("_decay", "slope_rate")):
            np.testing.assert_allclose(handed[key], want, rtol=1e-6, atol=0, err_msg=key)
        else:
            assert handed[key].tobytes() == want.tobytes(), key


def test_hybrid_sharded_equals_single_device(family, float32_gap):
    """8 CPU devices: batch over data, heads over tensor, experts over expert; equal within
    max(1e-5, twice the model's float32 gap) (partitioned matmuls sum in another order)."""
    _, _, _, model = family
    single = np.asarray(logits_of(model, jnp.asarray(IDS)))
    mesh = make_mesh(MeshConfig(data=2, tensor=2, expert=2))
    sharded, _ = shard_model(nnx.clone(model), mesh)
    specs = {str(path): var.sharding.spec for path, var in nnx.to_flat_state(nnx.state(sharded))}
    assert any("tensor" in str(spec) for key, spec in specs.items() if "attn" in key)
    assert any("expert" in str(spec) for key, spec in specs.items() if "mlp" in key)
    with jax.set_mesh(mesh):
        got = logits_of(sharded, jax.device_put(jnp.asarray(IDS), jax.sharding.NamedSharding(mesh, jax.P("data"))))
    np.testing.assert_allclose(np.asarray(got), single, atol=max(TOL["atol"], 2 * float32_gap[0]), rtol=TOL["rtol"])


def test_decoder_decode_with_a_misshapen_layer_state_names_it(family):
    _, _, _, model = family
    cache = model.init_cache(2, IDS.shape[1])
    bad_first_layer = jax.tree.map(lambda x: x[..., :-1], cache.layers[0])  # layer 0 is linear in both families
    wrong = cache._replace(layers=(bad_first_layer,) + cache.layers[1:])
    with pytest.raises(ValueError, match=r"(state|cache.conv) has shape \(2, \d+, \d+(, \d+)?\)"):
        decode_step(model, jnp.asarray(IDS[:, :1]), jnp.zeros((2, 1), jnp.int32), wrong)
