"""Softmax attention through cuDNN's fused flash attention on NVIDIA GPUs (docs/models.md#attention-implementations).

The function of `jaxrl.models.attention` for the full forward of rows that each hold **one sequence
followed by padding** (segment ids ``1 .. 1 0 .. 0``: the trainers' and scorers' unpacked rows), through
``jax.nn.dot_product_attention(implementation="cudnn")``: cuDNN's causal mask by index is the slot mask
(``q_slot = kv_slot = arange(T)``), and the row's length (its tokens with a segment id > 0) is cuDNN's
padding mask, so padding is never a key. Packed rows (several segments in a row, or a shared prompt's
tails) are not this layout: the trainers refuse ``attention_impl: cudnn`` with packing and ``auto`` runs
``chunked`` for them (`attention.packed_rows_impl`). A KV cache (decoding) runs `attention.DECODE_IMPL`.

Grouped-query attention is cuDNN's own: ``K`` key/value heads and ``K * G`` query heads, query head
``k * G + g`` reading key/value head ``k``. The kernel keeps the softmax statistics in float32 and takes
its inputs in the compute dtype (cuDNN supports bfloat16 and float16: a float32 model runs `chunked`).
Its memory is O(T) per head forward and backward, never the O(T^2) scores.

The custom call runs per device (`sharding.per_device_sequences`): rows over the "batch" axes and
key/value heads over "act_heads".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.sharding import per_device_sequences, target_platform

DTYPES = (jnp.bfloat16, jnp.float16)


def _local(q, k, v, q_segment_ids, kv_segment_ids, *, scale: float, dtype):
    """Whole sequences on one device: q `[B, T, K, G, D]`, k/v `[B, T, K, D]`, segment ids `[B, T]`."""
    del kv_segment_ids  # the full forward's: the same as the queries'
    batch, length, kv_heads, groups, dim = q.shape
    # At least one key per row: a row of padding only would be an empty softmax (its output is unused).
    lengths = jnp.maximum(jnp.sum(q_segment_ids > 0, axis=1), 1).astype(jnp.int32)
    # JAX's cuDNN path trains on even lengths only; the extra position is past every row's length.
    padded = length + length % 2

    def pad(x):
        return jnp.pad(x.astype(dtype), [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))

    out = jax.nn.dot_product_attention(
        pad(q.reshape(batch, length, kv_heads * groups, dim)), pad(k), pad(v), scale=scale, is_causal=True,
        query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation="cudnn")
    return out[:, :length].reshape(q.shape).astype(jnp.float32)


def cudnn_attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, scale: float, dtype,
                    block_size: int = 512) -> jax.Array:
    """`jaxrl.models.attention.xla_attention`'s result (`[B, T, K, G, D]` float32) for the full forward of
    rows holding one sequence then padding (the module docstring's contract)."""
    del q_slot, kv_slot, block_size  # the full forward's arange(T); cuDNN picks its own tiles
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"attention_impl = 'cudnn' runs the full forward only ({q.shape[1]} queries, "
                         f"{k.shape[1]} keys); decoding with a cache runs 'chunked' or 'xla'")
    platform = target_platform()
    if platform not in ("gpu", "cuda"):
        raise ValueError(f"attention_impl = 'cudnn' is NVIDIA's fused attention; this backend is {platform!r}: "
                         "choose 'auto', 'chunked' or 'xla'")
    if jnp.dtype(dtype) not in DTYPES:
        raise ValueError(f"attention_impl = 'cudnn' computes in bfloat16 or float16, and model.dtype is "
                         f"{jnp.dtype(dtype).name}: set model.dtype: bfloat16, or attention_impl: chunked")
    return per_device_sequences(
        lambda q, k, v, qs, ks: _local(q, k, v, qs, ks, scale=scale, dtype=dtype),
        q, k, v, q_segment_ids, kv_segment_ids, impl="cudnn")

