"""Softmax attention through the Pallas splash-attention kernel of TPUs (docs/models.md#attention-implementations).

The function of `jaxrl.models.attention` (same shapes, causal mask, segment ids, grouped-query
attention) for the full forward: queries and keys are the same `T` tokens in order (`q_slot =
kv_slot = arange(T)`), so the kernel's causal mask by index is the slot mask. A KV cache (decoding)
is not a full forward: the caller runs another implementation there (`Attention` runs `chunked`).

The kernel computes the softmax statistics in float32 from inputs in the compute dtype. Rows are
padded up to a multiple of the kernel block with a segment id (-1) that no token has, so padded keys
are never visible and padded queries see only padding; their outputs are dropped. Grouped-query
attention maps onto the kernel's multi-query form: each key/value head with its `G` query heads.

Mosaic kernels cannot be partitioned automatically: under a mesh the call runs per device
(`sharding.per_device_sequences`: rows over the "batch" axes, key/value heads over "act_heads").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.sharding import per_device_sequences, target_platform

BLOCK_MULTIPLE = 128  # TPU kernel blocks are multiples of the 128-lane width
PAD_SEGMENT = -1


def _kernel(groups: int, length: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length)) for _ in range(groups)])
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return kernel_lib.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret), \
        kernel_lib.SegmentIds


def _local(q, k, v, q_segment_ids, kv_segment_ids, *, scale, dtype, block_size, interpret):
    """Whole sequences on one device: q `[B, T, K, G, D]`, k/v `[B, T, K, D]`, segment ids `[B, T]`."""
    batch, length, _, groups, _ = q.shape
    block = max(BLOCK_MULTIPLE, block_size // BLOCK_MULTIPLE * BLOCK_MULTIPLE)
    block = min(block, -(-length // BLOCK_MULTIPLE) * BLOCK_MULTIPLE)
    padded = -(-length // block) * block
    kernel, segment_ids_type = _kernel(groups, padded, block, interpret)

    def pad(x, value=0):
        return jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

    q = pad((q.astype(jnp.float32) * scale).astype(dtype))
    k, v = pad(k.astype(dtype)), pad(v.astype(dtype))
    q_seg, kv_seg = pad(q_segment_ids, PAD_SEGMENT), pad(kv_segment_ids, PAD_SEGMENT)

    def one_head(q, k, v, q_seg, kv_seg):  # q [G, T, D], k/v [T, D]
        return kernel(q, k, v, segment_ids=segment_ids_type(q_seg, kv_seg))

    per_row = jax.vmap(one_head, in_axes=(0, 0, 0, None, None))  # over key/value heads
    out = jax.vmap(per_row)(q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                            q_seg, kv_seg)  # [B, K, G, T, D]
    return out.transpose(0, 3, 1, 2, 4)[:, :length].astype(jnp.float32)


def splash_attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, scale: float, dtype,
                     block_size: int = 512, interpret: bool = False) -> jax.Array:
    """`jaxrl.models.attention.xla_attention`'s result (`[B, T, K, G, D]` float32) for a full forward.

    `interpret` runs the kernel in the Pallas interpreter (any backend; for tests). `block_size` is
    rounded to a multiple of 128 and capped at the padded length."""
    del q_slot, kv_slot  # the full forward's arange(T): the kernel's causal mask by index is the same
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"attention_impl = 'splash' runs the full forward only ({q.shape[1]} queries, "
                         f"{k.shape[1]} keys); decoding with a cache runs 'chunked' or 'xla'")
    platform = target_platform()
    if not interpret and platform != "tpu":
        raise ValueError(f"attention_impl = 'splash' is the TPU Pallas kernel; this backend is "
                         f"{platform!r}: choose 'auto', 'chunked' or 'xla'")
    return per_device_sequences(
        lambda q, k, v, qs, ks: _local(q, k, v, qs, ks, scale=scale, dtype=dtype, block_size=block_size,
                                       interpret=interpret),
        q, k, v, q_segment_ids, kv_segment_ids, impl="splash")
