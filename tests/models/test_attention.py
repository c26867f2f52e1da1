"""Attention implementations (jaxrl.models.attention) against the XLA reference and the `attention_impl` switch.

Every implementation equals `xla` in values and in gradients with respect to q, k and v (float32) on odd
shapes (T, S not multiples of the blocks), grouped-query heads, packed rows, left and right padding and the
decode form (a KV cache with a prefill and a one-token step); a row with no visible key gives 0 and finite
gradients; whole decoders agree; the chunked form's compiled memory grows linearly in T.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import ModelConfig, load_hf_checkpoint
from jaxrl.models.attention import (ATTENTION_IMPLS, FULL_FORWARD_ONLY, _block_visibility, balanced_block, attention,
                                    chunked_attention, resolve_attention_impl, xla_attention)
from jaxrl.models.splash import splash_attention
from jaxrl.models.config import ATTENTION_IMPL_NAMES
from models_reference import decode, forward, padded_batch, qwen3_config, random_model

pytestmark = pytest.mark.fully_optimised  # compared with transformers at float32 rounding (conftest.py)

HEADS, GROUPS, DIM = 2, 3, 8  # K kv heads, G query heads per kv head (GQA), head size


def _case(name: str):
    """(T, S, q_slot, kv_slot, q_segment_ids, kv_segment_ids), numpy int32, batch 2."""
    if name == "one_sequence":  # T = S = 37: a multiple of no block size
        t = 37
        slot, seg = np.tile(np.arange(t), (2, 1)), np.ones((2, t))
        return t, t, slot, slot, seg, seg
    if name == "packed":  # three sequences in row 0, two in row 1
        seg = np.array([[1] * 10 + [2] * 15 + [3] * 12, [1] * 20 + [2] * 17])
        slot = np.tile(np.arange(37), (2, 1))
        return 37, 37, slot, slot, seg, seg
    if name == "shared_prefix":  # prompts laid out once, each followed by its samples' tails (packing)
        tail = lambda prefix, n: (1 << 30) + (prefix << 12) + n  # noqa: E731  (attention.tail_segment)
        seg = np.array([[1] * 8 + [tail(1, 1)] * 9 + [tail(1, 2)] * 7 + [2] * 6 + [3] * 4 + [tail(3, 1)] * 3,
                        [1] * 12 + [tail(1, 1)] * 13 + [tail(1, 2)] * 12])
        slot = np.tile(np.arange(37), (2, 1))
        return 37, 37, slot, slot, seg, seg
    if name in ("right_pad", "left_pad"):
        seg = np.ones((2, 29))
        seg[1, slice(18, None) if name == "right_pad" else slice(0, 11)] = 0
        slot = np.tile(np.arange(29), (2, 1))
        return 29, 29, slot, slot, seg, seg
    if name in ("prefill", "decode_step"):  # a 31-row cache; row 1 left-padded by 2
        cache, t = 31, (7 if name == "prefill" else 1)
        write_index = np.array([0, 9]) if name == "prefill" else np.array([13, 22])
        q_slot = write_index[:, None] + np.arange(t)
        kv_slot = np.tile(np.arange(cache), (2, 1))
        kv_seg = (kv_slot < (write_index + t)[:, None]).astype(np.int32)  # written rows; the rest empty (0)
        kv_seg[1, :2] = 0  # row 1's left padding
        q_seg = np.take_along_axis(kv_seg, q_slot, axis=1)
        return t, cache, q_slot, kv_slot, q_seg, kv_seg
    raise ValueError(name)


CASES = ["one_sequence", "packed", "shared_prefix", "right_pad", "left_pad", "prefill", "decode_step"]
# (case, block_q, block_k): odd blocks everywhere, blocks of 8 x 16 and single blocks on some
CASE_BLOCKS = ([(case, 5, 7) for case in CASES]
               + [(case, 8, 16) for case in ("one_sequence", "packed", "shared_prefix", "prefill")]
               + [(case, 512, 512) for case in ("one_sequence", "decode_step")])


def _inputs(t, s, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, t, HEADS, GROUPS, DIM))
    k, v = rng.normal(size=(2, s, HEADS, DIM)), rng.normal(size=(2, s, HEADS, DIM))
    cotangent = rng.normal(size=(2, t, HEADS, GROUPS, DIM))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(cotangent, jnp.float32)


def _value_and_grads(fn, qkv, masks, cotangent, dtype=jnp.float32):
    """(out, (dq, dk, dv)) of fn, with the cotangent `cotangent` on the output."""
    masks = tuple(jnp.asarray(m, jnp.int32) for m in masks)

    def loss(q, k, v):
        out = fn(q, k, v, *masks, scale=DIM ** -0.5, dtype=dtype)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv)
    return np.asarray(out), tuple(np.asarray(g, np.float32) for g in grads)


def _close(actual, expected, rel=1e-5):
    """Within `rel` of the largest reference value (an absolute bound of rel * max |expected|)."""
    err, scale = np.abs(actual - expected).max(), max(np.abs(expected).max(), 1e-30)
    assert err <= rel * scale, f"max error {err:.3e} > {rel:.0e} x {scale:.3e}"


@pytest.mark.parametrize("case,block_q,block_k", CASE_BLOCKS)
def test_chunked_equals_xla_values_and_gradients(case, block_q, block_k):
    t, s, *masks = _case(case)
    qkv, cotangent = _inputs(t, s)
    out_x, grads_x = _value_and_grads(xla_attention, qkv, masks, cotangent)
    chunked = functools.partial(chunked_attention, block_q=block_q, block_k=block_k)
    out_c, grads_c = _value_and_grads(chunked, qkv, masks, cotangent)
    real = masks[2] != 0
    _close(out_c[real], out_x[real])  # the real tokens, and padding too
    _close(out_c, out_x)
    for got, want in zip(grads_c, grads_x, strict=True):
        _close(got, want)


# Kernels of other backends run in the Pallas interpreter here (the same kernel program, on CPU). cuDNN has
# no interpreter: its wrapper runs with JAX's reference kernel below, its lowering is checked for an H100 by
# tests/compile/test_gpu_aot.py and its values on a GPU by bench/gpu_checks.sh.
INTERPRET = {"splash"}
GPU_ONLY = {"cudnn"}


@pytest.mark.parametrize("name", sorted(set(ATTENTION_IMPLS) - GPU_ONLY))
def test_every_registered_impl_equals_xla(name):
    t, s, *masks = _case("packed")
    qkv, cotangent = _inputs(t, s, seed=1)
    impl = functools.partial(ATTENTION_IMPLS[name], block_size=16, **({"interpret": True} if name in INTERPRET else {}))
    out, grads = _value_and_grads(impl, qkv, masks, cotangent)
    out_x, grads_x = _value_and_grads(xla_attention, qkv, masks, cotangent)
    _close(out, out_x)
    for got, want in zip(grads, grads_x, strict=True):
        _close(got, want)


@pytest.mark.parametrize("case", ["packed", "shared_prefix", "decode_step"])
def test_xla_matches_a_float64_softmax(case):
    """Packed segments; shared-prefix tails (a tail also sees its prefix: ids 2^30 + (prefix << 12) + n);
    a decode step (one query per row: the broadcast form that reads the cache in place)."""
    t, s, q_slot, kv_slot, q_seg, kv_seg = _case(case)
    (q, k, v), _ = _inputs(t, s, seed=2)
    out = np.asarray(xla_attention(q, k, v, *(jnp.asarray(m, jnp.int32) for m in (q_slot, kv_slot, q_seg, kv_seg)),
                                   scale=DIM ** -0.5, dtype=jnp.float32))
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("btkgd,bskd->bkgts", q, k) * DIM ** -0.5
    prefix = np.where(q_seg >= 1 << 30, (q_seg - (1 << 30)) // (1 << 12), q_seg)
    visible = (kv_slot[:, None, :] <= q_slot[:, :, None]) & ((kv_seg[:, None, :] == q_seg[:, :, None])
                                                             | (kv_seg[:, None, :] == prefix[:, :, None]))
    scores = np.where(visible[:, None, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bkgts,bskd->btkgd", probs / probs.sum(-1, keepdims=True), v)
    _close(out, expected)


@pytest.mark.parametrize("name", sorted(set(ATTENTION_IMPLS) - FULL_FORWARD_ONLY))
def test_rows_that_see_no_key_give_zero_and_finite_gradients(name):
    """Row 0, query 3 has a segment id no key has; row 1's queries come before every key slot.
    (In a full forward every query sees its own key, so full-forward-only kernels never meet such rows.)"""
    t, s = 6, 11
    q_slot = np.tile(np.arange(t), (2, 1))
    kv_slot = np.tile(np.arange(s), (2, 1))
    kv_slot[1] += 4
    q_seg, kv_seg = np.ones((2, t)), np.ones((2, s))
    q_seg[0, 3] = 7
    qkv, cotangent = _inputs(t, s, seed=3)
    impl = functools.partial(ATTENTION_IMPLS[name], block_size=4)
    out, grads = _value_and_grads(impl, qkv, (q_slot, kv_slot, q_seg, kv_seg), cotangent)
    blind = np.zeros((2, t), bool)
    blind[0, 3], blind[1, :4] = True, True
    assert np.all(out[blind] == 0) and np.abs(out[~blind]).max() > 0
    for g in grads:
        assert np.all(np.isfinite(g))
    assert np.all(grads[0][blind] == 0)


def test_block_skip_rule():
    """Causal blocks above the diagonal and blocks of different packed sequences are skipped."""
    blocks = lambda x, b: jnp.asarray(x, jnp.int32).reshape(1, -1, b).transpose(1, 0, 2)  # noqa: E731
    slot = np.arange(64)[None]
    visible, (first, stop), (q_first, q_stop) = _block_visibility(blocks(slot, 16), blocks(np.ones((1, 64)), 16),
                                                                  blocks(slot, 16), blocks(np.ones((1, 64)), 16))
    np.testing.assert_array_equal(np.asarray(visible), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(np.asarray(first), 0)
    np.testing.assert_array_equal(np.asarray(stop), [1, 2, 3, 4])
    np.testing.assert_array_equal(np.asarray(q_first), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(q_stop), 4)
    seg = np.repeat([1, 2], 32)[None]
    visible, _, _ = _block_visibility(blocks(slot, 16), blocks(seg, 16), blocks(slot, 16), blocks(seg, 16))
    np.testing.assert_array_equal(np.asarray(visible), [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])


def test_block_sizes_are_balanced_and_bounded():
    """(length, block) -> block used: at most `block`, little padding, one row for a decode step."""
    for (length, block), used in {(700, 512): 352, (4096, 512): 512, (37, 12): 10, (37, 5): 5, (1, 512): 1,
                                  (7, 512): 7}.items():
        assert balanced_block(length, block) == used


def test_chunked_bfloat16_close_to_xla():
    t, s, *masks = _case("packed")
    qkv, cotangent = _inputs(t, s, seed=4, dtype=jnp.bfloat16)
    out_x, grads_x = _value_and_grads(xla_attention, qkv, masks, cotangent, jnp.bfloat16)
    chunked = functools.partial(chunked_attention, block_q=8, block_k=16)
    out_c, grads_c = _value_and_grads(chunked, qkv, masks, cotangent, jnp.bfloat16)
    _close(out_c, out_x, rel=2e-2)
    for got, want in zip(grads_c, grads_x, strict=True):
        _close(got, want, rel=3e-2)


# ---- the switch ---------------------------------------------------------------------------------------------


def test_registry_and_auto():
    assert set(ATTENTION_IMPLS) == set(ATTENTION_IMPL_NAMES) - {"auto"}
    assert [resolve_attention_impl("auto", backend) for backend in ("cpu", "gpu", "tpu")] == [
        "chunked", "cudnn", "splash"]
    # cuDNN takes bfloat16 and float16: a float32 model's "auto" on a GPU is chunked
    assert resolve_attention_impl("auto", "gpu", dtype=jnp.float32) == "chunked"
    assert resolve_attention_impl("auto", "gpu", dtype=jnp.bfloat16) == "cudnn"
    assert resolve_attention_impl("xla") == "xla"
    with pytest.raises(ValueError, match="attention_impl = 'flash'.*'auto', 'xla', 'chunked', 'splash', 'cudnn'"):
        resolve_attention_impl("flash")


@pytest.mark.parametrize("case", ["one_sequence", "right_pad"])
def test_cudnn_wrapper_equals_xla_with_the_reference_kernel(case, monkeypatch):
    """jaxrl's side of cuDNN attention (grouped heads folded into cuDNN's query heads, the row's length
    as its padding mask, odd lengths padded to even) with ``jax.nn.dot_product_attention``'s own XLA
    implementation in place of the cuDNN kernel (same arguments): values and gradients of the real
    tokens in bfloat16, against `xla_attention`. A padded query's output is unused (cuDNN zeroes it)."""
    from jaxrl.models import cudnn

    reference = jax.nn.dot_product_attention
    monkeypatch.setattr(cudnn.jax.nn, "dot_product_attention",
                        lambda *a, implementation, **kw: reference(*a, implementation="xla", **kw))
    monkeypatch.setattr(cudnn, "target_platform", lambda: "gpu")
    t, s, *masks = _case(case)
    qkv, cotangent = _inputs(t, s, seed=5, dtype=jnp.bfloat16)
    real = jnp.asarray(masks[2] != 0)
    cotangent = cotangent * real[:, :, None, None, None]
    out, grads = _value_and_grads(cudnn.cudnn_attention, qkv, masks, cotangent, dtype=jnp.bfloat16)
    out_x, grads_x = _value_and_grads(xla_attention, qkv, masks, cotangent, dtype=jnp.bfloat16)
    _close(np.asarray(out)[np.asarray(real)], np.asarray(out_x)[np.asarray(real)], rel=3e-2)
    for got, want in zip(grads, grads_x, strict=True):
        _close(np.asarray(got, np.float32), np.asarray(want, np.float32), rel=3e-2)


def test_cudnn_refuses_other_backends_float32_and_packed_rows():
    from jaxrl.models.attention import packed_rows_impl
    from jaxrl.models.cudnn import cudnn_attention

    qkv, _ = _inputs(8, 8, dtype=jnp.bfloat16)
    rows = (jnp.ones((2, 8), jnp.int32),) * 4
    with pytest.raises(ValueError, match="'cudnn' is NVIDIA's fused attention; this backend is 'cpu'"):
        cudnn_attention(*qkv, *rows, scale=1.0, dtype=jnp.bfloat16)
    assert packed_rows_impl("auto", "gpu") == "chunked" and packed_rows_impl("auto", "tpu") == "auto"
    assert packed_rows_impl("xla", "gpu") == "xla"
    with pytest.raises(ValueError, match="model.attention_impl: cudnn .* set update.pack"):
        packed_rows_impl("cudnn", "gpu")


@pytest.mark.parametrize("case", ["one_sequence", "right_pad", "left_pad"])
def test_splash_kernel_equals_xla(case):
    """The TPU kernel's program in the Pallas interpreter: values and gradients of the full forward (rows of
    29 or 37 tokens padded to one 128-token kernel block with a segment id no token has)."""
    t, s, *masks = _case(case)
    qkv, cotangent = _inputs(t, s, seed=3)
    out_x, grads_x = _value_and_grads(xla_attention, qkv, masks, cotangent)
    out, grads = _value_and_grads(functools.partial(splash_attention, interpret=True), qkv, masks, cotangent)
    _close(out, out_x)
    for got, want in zip(grads, grads_x, strict=True):
        _close(got, want)


def test_splash_refuses_other_backends_and_leaves_the_cache_to_chunked():
    t, s, *masks = _case("prefill")
    qkv, cotangent = _inputs(t, s, seed=4)
    masks = tuple(jnp.asarray(m, jnp.int32) for m in masks)
    with pytest.raises(ValueError, match="'splash' is the TPU Pallas kernel; this backend is 'cpu'"):
        splash_attention(*_inputs(8, 8)[0], *(jnp.ones((2, 8), jnp.int32),) * 4, scale=1.0, dtype=jnp.float32)
    with pytest.raises(ValueError, match="'splash' runs the full forward only"):
        splash_attention(*qkv, *masks, scale=1.0, dtype=jnp.float32, interpret=True)
    # a KV cache (7 queries, 31 keys): the dispatcher runs DECODE_IMPL, so decoding works with 'splash' set
    out = attention(*qkv, *masks, impl="splash", scale=DIM ** -0.5, dtype=jnp.float32, block_size=8)
    _close(np.asarray(out), np.asarray(xla_attention(*qkv, *masks, scale=DIM ** -0.5, dtype=jnp.float32)))


@pytest.mark.parametrize("changes,pattern", [
    (dict(attention_impl="flash"),
     r"attention_impl = 'flash'; choose one of \['auto', 'xla', 'chunked', 'splash', 'cudnn'\]"),
    (dict(attention_block_size=0), r"attention_block_size must be a positive integer, got 0"),
])
def test_bad_attention_fields_are_named(changes, pattern):
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8)
    assert ModelConfig(**base).attention_impl == "auto"
    with pytest.raises(ValueError, match=pattern):
        ModelConfig(**base, **changes)


def test_attention_fields_are_runtime_not_hf():
    hf = qwen3_config(tie=True).to_dict()
    hf["architectures"] = ["Qwen3ForCausalLM"]
    config = ModelConfig.from_hf(hf, attention_impl="xla", attention_block_size=64)
    assert (config.attention_impl, config.attention_block_size) == ("xla", 64)
    exported = config.to_hf()
    assert not any("attention_impl" in key or "block_size" in key for key in exported)
    assert ModelConfig.from_hf(exported, attention_impl="xla", attention_block_size=64) == config


def test_decoder_chunked_equals_xla(tmp_path):
    """Full forward (left-padded and packed rows, T = 13) and prefill + decode, block size 4."""
    random_model(qwen3_config(tie=False), seed=6).save_pretrained(tmp_path)
    models = {impl: load_hf_checkpoint(str(tmp_path), attention_impl=impl, attention_block_size=4)
              for impl in ("xla", "chunked")}
    ids, mask, positions = padded_batch(seed=7, length=13, left=True)
    segments = mask.copy()
    segments[0, 6:], positions[0, 6:] = 2, np.arange(7)  # row 0 holds two packed sequences
    logits = {impl: np.asarray(forward(m, *(jnp.asarray(a) for a in (ids, positions, segments))))
              for impl, m in models.items()}
    real = segments != 0
    assert np.abs(logits["chunked"] - logits["xla"])[real].max() < 1e-5
    assert np.abs(logits["chunked"][real]).max() > 1  # logits of a random model, not ~0

    ids, mask, positions = padded_batch(seed=8, length=10, left=True)
    decoded = {}
    for impl, model in models.items():
        cache, pieces = model.init_cache(3, 16), []
        for start, stop in ((0, 7), (7, 8), (8, 9), (9, 10)):  # prefill 7, then one token per step
            step = (jnp.asarray(a[:, start:stop]) for a in (ids, positions, mask))
            out, cache = decode(model, *step, cache)
            pieces.append(np.asarray(out))
        decoded[impl] = np.concatenate(pieces, axis=1)
    assert np.abs(decoded["chunked"] - decoded["xla"])[mask == 1].max() < 1e-5


# ---- memory ---------------------------------------------------------------------------------------------


def attention_temp_bytes(fn, length: int, batch: int = 1, heads: int = 2, groups: int = 2, dim: int = 64) -> int:
    """XLA's temporary bytes of a compiled forward + backward (nothing runs: ShapeDtypeStruct inputs)."""
    def loss(q, k, v, slot, seg):
        return jnp.sum(fn(q, k, v, slot, slot, seg, seg, scale=dim ** -0.5, dtype=jnp.float32))

    shape = jax.ShapeDtypeStruct
    args = (shape((batch, length, heads, groups, dim), jnp.float32), shape((batch, length, heads, dim), jnp.float32),
            shape((batch, length, heads, dim), jnp.float32), shape((batch, length), jnp.int32),
            shape((batch, length), jnp.int32))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_memory_grows_linearly():
    """T 2048 -> 4096: chunked temporaries grow <= 2.2x (measured 1.21x), xla's about 4x (measured 3.98x)."""
    chunked = functools.partial(chunked_attention, block_q=512, block_k=512)
    growth = attention_temp_bytes(chunked, 4096) / attention_temp_bytes(chunked, 2048)
    xla_growth = attention_temp_bytes(xla_attention, 4096) / attention_temp_bytes(xla_attention, 2048)
    assert growth <= 2.2, growth
    assert xla_growth > 3.5, xla_growth


def test_auto_runs_attention_that_fits_one_block_with_the_reference_einsum():
    """One block saves no memory; up to the block size ``auto`` keeps the reference numerics."""
    assert resolve_attention_impl("auto", "cpu", length=512, block_size=512) == "xla"
    assert resolve_attention_impl("auto", "cpu", length=513, block_size=512) == "chunked"
    assert resolve_attention_impl("chunked", "cpu", length=8, block_size=512) == "chunked"
