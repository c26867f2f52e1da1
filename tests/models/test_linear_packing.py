"""Packed rows through linear attention (docs/models.md#linear-attention): the kernels' `reset`, the
layers' segment resets and masked short convolution, and a hybrid Decoder (softmax + lightning +
gated DeltaNet layers, MoE). Every segment of a packed row gets the outputs it gets alone in its own
row, changing one segment changes nothing in the others (outputs or gradients), and a row holding
one sequence, padded anywhere, computes exactly what it computed before packing existed.

float32 on CPU; tolerance 1e-5 (a segment alone is chunked at other offsets, so it rounds differently).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, ModelConfig
from jaxrl.models import linear_attention as la
from jaxrl.models import linear_layers as ll

TOL = dict(atol=1e-5, rtol=1e-5)
ROW = 28
# Row 0: three segments of odd lengths, then padding. Row 1: padding between segments and at the start.
LAYOUTS = ([(1, 5), (2, 11), (3, 7), (0, 5)], [(0, 2), (1, 9), (0, 3), (2, 7), (3, 6), (0, 1)])
KINDS = {"lightning_attention": ll.LightningAttention, "gated_deltanet": ll.GatedDeltaNet}


def packed(layouts=LAYOUTS):
    """segment_ids, positions [B, ROW] int32 and, per row, {segment id: slice of its tokens}."""
    segment_ids, positions = np.zeros((len(layouts), ROW), np.int32), np.zeros((len(layouts), ROW), np.int32)
    spans = []
    for row, layout in enumerate(layouts):
        start, found = 0, {}
        for segment, length in layout:
            if segment:
                found[segment] = slice(start, start + length)
                segment_ids[row, found[segment]] = segment
                positions[row, found[segment]] = np.arange(length)
            start += length
        assert start == ROW
        spans.append(found)
    return segment_ids, positions, spans


def randomize(module, seed, gain=1.0):
    """O(1) activations (the default init gives ~1e-3): matrices ~ N(0, gain^2 / fan_in), vectors (norm
    scales, dt_bias) their init + 0.3 N, A_log = log U(0.1, 2.1)."""
    params = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = []
    for (path, value), key in zip(leaves, keys, strict=True):
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(key, value.shape, jnp.float32)
        if "A_log" in name:
            value = jnp.log(jax.random.uniform(key, value.shape, jnp.float32, 0.1, 2.1))
        elif value.ndim == 1:  # norm scales (1, or 0 for Qwen3-Next's offset norms), dt_bias
            value = value + 0.3 * noise
        else:
            value = gain * noise / np.sqrt(value.shape[-2])
        new.append(value.astype(jnp.float32))
    nnx.update(module, jax.tree_util.tree_unflatten(treedef, new))
    return module


def layer_config(**overrides):
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6, linear_chunk_size=4,
                  layer_types=("lightning_attention", "gated_deltanet", "full_attention", "lightning_attention"))
    fields.update(overrides)
    return ModelConfig(**fields)


@nnx.jit
def run_layer(layer, x, segment_ids, positions):
    return layer(x, positions=positions, segment_ids=segment_ids)[0]


def alone(fn, inputs, spans):
    """fn on every segment's tokens in a row of its own (segment id 1 and positions from 0 at the start,
    padding after it up to ROW columns), all rows in one call (one compile): {(row, segment): output}."""
    keys = [(row, segment, span) for row, found in enumerate(spans) for segment, span in found.items()]
    rows = np.zeros((len(keys),) + tuple(inputs.shape[1:]), np.asarray(inputs).dtype)
    segment_ids, positions = np.zeros((len(keys), ROW), np.int32), np.zeros((len(keys), ROW), np.int32)
    for i, (row, _, span) in enumerate(keys):
        length = span.stop - span.start
        rows[i, :length] = np.asarray(inputs[row, span])
        segment_ids[i, :length], positions[i, :length] = 1, np.arange(length)
    out = fn(jnp.asarray(rows), jnp.asarray(segment_ids), jnp.asarray(positions))
    return {(row, segment): out[i, : span.stop - span.start] for i, (row, segment, span) in enumerate(keys)}


# ---------------------------------------------------------------- kernels
def loop_reference(q, k, v, g, beta, reset):
    """Token loop in float64, the state zeroed before every reset token; beta None = lightning."""
    batch, length, heads, dk = q.shape
    state, outs = np.zeros((batch, heads, dk, v.shape[-1])), []
    for t in range(length):
        state = state * (np.exp(g[:, t]) * ~reset[:, t, None])[..., None, None]
        write = v[:, t] if beta is None else beta[:, t][..., None] * (
            v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + np.einsum("bhk,bhv->bhkv", k[:, t], write)
        outs.append(np.einsum("bhk,bhkv->bhv", q[:, t], state))
    return np.stack(outs, axis=1), state


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 32])  # resets mid-chunk, on chunk starts, one chunk
def test_kernels_reset_the_state_exactly(chunk_size):
    rng = np.random.default_rng(0)
    batch, length, heads, dk, dv = 2, 23, 3, 4, 5
    q, k = rng.normal(size=(2, batch, length, heads, dk))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(batch, length, heads, dv))
    g = -rng.uniform(0.01, 1.0, size=(batch, length, heads))
    beta = rng.uniform(0.0, 1.0, size=(batch, length, heads))
    log_decay = -rng.uniform(0.01, 1.0, size=(heads,))
    reset = np.zeros((batch, length), bool)
    reset[0, [5, 16]] = True
    reset[1, [4, 8, 9, 20]] = True
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, log_decay)]
    lightning = jax.jit(la.lightning_attention, static_argnames="chunk_size")(
        *f32[:3], f32[5], chunk_size=chunk_size, reset=jnp.asarray(reset))
    delta = jax.jit(la.gated_delta_rule, static_argnames="chunk_size")(
        *f32[:5], chunk_size=chunk_size, reset=jnp.asarray(reset))
    cases = [(lightning, np.broadcast_to(log_decay, g.shape), None), (delta, g, beta)]
    for (out, state), gate, write_strength in cases:
        want_out, want_state = loop_reference(q, k, v, gate, write_strength, reset)
        np.testing.assert_allclose(out, want_out, **TOL)
        np.testing.assert_allclose(state, want_state, **TOL)


def test_kernel_reset_on_the_first_token_drops_the_initial_state():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 2, 3)), jnp.float32) for _ in range(3))
    state0 = jnp.asarray(rng.normal(size=(1, 2, 3, 3)), jnp.float32)
    reset = jnp.zeros((1, 6), bool).at[0, 0].set(True)
    with_state, _ = la.lightning_attention(q, k, v, jnp.full((2,), -0.5), chunk_size=4, initial_state=state0,
                                           reset=reset)
    without, _ = la.lightning_attention(q, k, v, jnp.full((2,), -0.5), chunk_size=4)
    np.testing.assert_allclose(with_state, without, **TOL)
    g, beta = jnp.full((1, 6, 2), -0.3), jnp.full((1, 6, 2), 0.5)
    with_state, _ = la.gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=state0, reset=reset)
    np.testing.assert_allclose(with_state, la.gated_delta_rule(q, k, v, g, beta, chunk_size=4)[0], **TOL)
    with pytest.raises(ValueError, match=r"reset has shape \(1, 5\), expected \(1, 6\)"):
        la.gated_delta_rule(q, k, v, jnp.zeros((1, 6, 2)), jnp.ones((1, 6, 2)), reset=reset[:, :5])


# ---------------------------------------------------------------- layers
@pytest.fixture(scope="module", params=sorted(KINDS))
def layer(request):
    return randomize(KINDS[request.param](layer_config(), rngs=nnx.Rngs(0), layer_index=1), seed=2)


def test_layer_packed_segments_equal_their_own_rows(layer):
    segment_ids, positions, spans = packed()
    x = jnp.asarray(np.random.default_rng(3).normal(size=(len(spans), ROW, 32)), jnp.float32)
    got = run_layer(layer, x, jnp.asarray(segment_ids), jnp.asarray(positions))
    wanted = alone(lambda *a: run_layer(layer, *a), x, spans)
    for row, found in enumerate(spans):
        for segment, span in found.items():
            np.testing.assert_allclose(got[row, span], wanted[row, segment], **TOL)


def test_layer_segments_do_not_leak_outputs_or_gradients(layer):
    segment_ids, positions, spans = packed()
    segment_ids, positions = jnp.asarray(segment_ids), jnp.asarray(positions)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(len(spans), ROW, 32)), jnp.float32)
    changed = x
    for row, found in enumerate(spans):
        changed = changed.at[row, found[1]].set(rng.normal(size=(found[1].stop - found[1].start, 32)))
    base, other = (np.asarray(run_layer(layer, a, segment_ids, positions)) for a in (x, changed))
    for row, found in enumerate(spans):
        assert np.abs(base[row, found[1]] - other[row, found[1]]).max() > 1e-2  # the change is seen...
        for segment in (2, 3):  # ...and only by its own segment
            np.testing.assert_array_equal(base[row, found[segment]], other[row, found[segment]])

    weights = jnp.asarray(rng.normal(size=(len(spans), ROW, 32)), jnp.float32)
    on_segment_2 = jnp.asarray(segment_ids == 2)[..., None]

    def loss(x):
        return jnp.sum(jnp.where(on_segment_2, layer(x, positions=positions, segment_ids=segment_ids)[0] * weights, 0))

    grad = np.asarray(jax.jit(jax.grad(loss))(x))
    for row, found in enumerate(spans):
        assert np.abs(grad[row, found[2]]).max() > 1e-3
        assert not grad[row, found[1]].any() and not grad[row, found[3]].any()


def test_layer_one_sequence_per_row_is_unchanged_by_packing(layer):
    """A single sequence padded anywhere: no reset, no masked tap, so the full forward computes exactly the
    numbers of the cached path (which never resets, as before packing existed) and of segment_ids=None."""
    segment_ids = np.ones((3, ROW), np.int32)
    segment_ids[1, :4] = 0  # left padding
    segment_ids[2, 9:13] = 0  # padding inside the sequence (a right-padded prompt, then its completion)
    segment_ids[2, -2:] = 0
    x = jnp.asarray(np.random.default_rng(5).normal(size=(3, ROW, 32)), jnp.float32)
    positions = jnp.zeros((3, ROW), jnp.int32)  # unused by linear layers
    got = run_layer(layer, x, jnp.asarray(segment_ids), positions)
    cached = nnx.jit(lambda m, x, s, c: m(x, positions=positions, segment_ids=s, cache=c)[0])(
        layer, x, jnp.asarray(segment_ids), layer.init_cache(3))
    np.testing.assert_array_equal(got, cached)
    np.testing.assert_array_equal(got[0], nnx.jit(lambda m, x: m(x)[0])(layer, x)[0])  # row 0: no padding


def test_carried_segments_skip_padding():
    carried, reset = ll.carried_segments(jnp.asarray([[0, 0, 1, 1, 0, 1, 2, 0, 0, 3, 3, 0]]))
    np.testing.assert_array_equal(carried[0], [0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(reset[0], [0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0])


# ---------------------------------------------------------------- hybrid decoder
HYBRIDS = {
    "minimax-switches": dict(
        layer_types=("lightning_attention", "gated_deltanet", "full_attention", "lightning_attention"),
        qk_norm=False, residual_from_norm=True),
    "qwen3-next-switches": dict(
        layer_types=("gated_deltanet", "lightning_attention", "full_attention", "gated_deltanet"),
        attention_output_gate=True, partial_rotary_factor=0.25, norm_weight_offset=True, shared_expert_gate=True,
        shared_expert_intermediate_size=12, mlp_types=("moe", "dense", "moe", "moe")),
}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request):
    """Conditioned so that float32 resolves it to ~1e-6 (a segment alone at another row length moves its
    logits by ~1e-6; packed, 5e-6 at most): gain 0.5, and DeltaNet heads of 16 (its per-head RMSNorm over
    6 features amplifies rounding of a small-norm head output, ~1e-5 then)."""
    overrides = dict(mlp_types=("moe",) * 4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                     rope_theta=10000.0, linear_key_head_dim=16, linear_value_head_dim=16)
    overrides.update(HYBRIDS[request.param])
    return randomize(Decoder(layer_config(**overrides), rngs=nnx.Rngs(6)), seed=7, gain=0.5)


@nnx.jit
def logits(model, ids, segment_ids, positions):
    return model.logits(ids, positions, segment_ids)


def test_decoder_packed_segments_equal_their_own_rows_and_do_not_leak(hybrid):
    segment_ids, positions, spans = packed()
    rng = np.random.default_rng(8)
    ids = jnp.asarray(rng.integers(0, 64, size=(len(spans), ROW)))
    got = np.asarray(logits(hybrid, ids, jnp.asarray(segment_ids), jnp.asarray(positions)))
    assert np.abs(got).max() > 1.0
    wanted = alone(lambda *a: logits(hybrid, *a), ids, spans)
    for row, found in enumerate(spans):
        for segment, span in found.items():
            np.testing.assert_allclose(got[row, span], wanted[row, segment], **TOL)

    changed = ids
    for row, found in enumerate(spans):
        changed = changed.at[row, found[1]].set((ids[row, found[1]] + 1 + jnp.arange(found[1].stop - found[1].start))
                                                % 64)
    other = np.asarray(logits(hybrid, changed, jnp.asarray(segment_ids), jnp.asarray(positions)))
    for row, found in enumerate(spans):
        assert np.abs(got[row, found[1]] - other[row, found[1]]).max() > 1e-2
        for segment in (2, 3):  # bit for bit: every cross-segment term is an exact 0 (masked softmax included)
            np.testing.assert_array_equal(got[row, found[segment]], other[row, found[segment]])
