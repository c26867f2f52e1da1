"""Ring attention, the second context-parallel mode (`ModelConfig.context_parallel = "ring"`,
docs/models.md#context-parallelism): Liu et al. 2023, https://arxiv.org/abs/2310.01889, with the
load-balanced zig-zag split of the causal row.

Layout. A row of T columns is cut into 2s chunks of T / 2s, and sequence shard j (of s) holds chunks j
and 2s-1-j (`context_parallel.column_positions`). The decoder moves its `[B, T, ...]` inputs into this
layout once, before the embedding, and its outputs back once, after the final norm (`to_ring_layout`,
`from_ring_layout`: two `ppermute`s each, every half shard going to one other shard). Every layer in
between works per token, except the token mixers: softmax attention reads each column's position in the
row from the slots, and linear attention runs Ulysses, putting the gathered columns back in row order.

Attention (`ring_attention`), per device inside `jax.shard_map` over the sequence axes (batch and heads
keep their logical rules): the queries stay; the key/value block, with its slots and segment ids, goes
around the ring (`ppermute` to shard j+1) in s steps, and for each block it holds the device runs the
chunked kernel's blocked online softmax (`attention.flash_forward`, block skipping included), which
gives the partial output `o_r` and logsumexp `l_r` of its queries over that block's visible keys. The
partials merge in float32 (the online softmax over ring steps, with `l = m + log(sum)`):

    l = logaddexp(l, l_r),    o = o e^{l_old - l} + o_r e^{l_r - l}

and a query that sees no key anywhere gives 0. Causal masking is by global positions (the slots) and
packed rows by the segment ids that travel with the keys, so padding (segment 0) is masked as in
`attention`. Of the four (query chunk, key chunk) pairs of shards i != j exactly two are visible
under the causal mask and two are skipped whole, and shard j's causal work is the same for every j.

Gradients: a `custom_vjp` over the ring saves only q, k, v, the output and the logsumexp (O(T / s) per
device) and runs a second ring: each device recomputes its queries' probabilities against the block it
holds (`attention.flash_gradients`, with the global output and logsumexp), keeps dQ, and adds dK, dV to
accumulators that travel with the block and are back home after s steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl.models.attention import (balanced_block, blocked_keys, blocked_queries, flash_forward, flash_gradients,
                                    unblocked)
from jaxrl.models.context_parallel import TOKEN_AXES, Plan
from jaxrl.models.sharding import logical_to_spec

F32 = jnp.float32


def _chunk_home(chunk: int, shards: int) -> int:
    """The shard that holds `chunk` (of 2 x shards) in the zig-zag layout."""
    return min(chunk, 2 * shards - 1 - chunk)


def _move(x: jax.Array, plan: Plan, to_ring: bool) -> jax.Array:
    """`[B, T, ...]` sharded on "length" between the contiguous layout (shard i holds chunks 2i and 2i+1)
    and the zig-zag one (shard j holds chunks j and 2s-1-j). A zig-zag shard holds one even and one odd
    chunk, so the even chunks (first halves of the contiguous shards) travel by one permutation of the
    shards and the odd ones by another."""
    shards, axis = plan.shards, plan.sequence_axes
    even = [(i, _chunk_home(2 * i, shards)) for i in range(shards)]
    odd = [(i, _chunk_home(2 * i + 1, shards)) for i in range(shards)]

    def back(pairs):
        return [(dst, src) for src, dst in pairs]

    def local(x):
        first, second = jnp.split(x, 2, axis=1)
        even_first = jax.lax.axis_index(axis) % 2 == 0  # zig-zag shard j's chunk j is even when j is
        if to_ring:
            e, o = jax.lax.ppermute(first, axis, even), jax.lax.ppermute(second, axis, odd)
            return jnp.where(even_first, jnp.concatenate([e, o], 1), jnp.concatenate([o, e], 1))
        e, o = jnp.where(even_first, first, second), jnp.where(even_first, second, first)
        return jnp.concatenate([jax.lax.ppermute(e, axis, back(even)), jax.lax.ppermute(o, axis, back(odd))], 1)

    spec = logical_to_spec(("batch", "length"), x.shape[:2], jax.sharding.get_abstract_mesh())
    return jax.shard_map(local, in_specs=spec, out_specs=spec, check_vma=False)(x)


def to_ring_layout(x: jax.Array, plan: Plan) -> jax.Array:
    """`[B, T, ...]` in row order -> the zig-zag layout of `plan`; column c then holds row position
    `context_parallel.column_positions(plan, T)[c]`."""
    return _move(x, plan, to_ring=True)


def from_ring_layout(x: jax.Array, plan: Plan) -> jax.Array:
    """The inverse of `to_ring_layout`."""
    return _move(x, plan, to_ring=False)


def _merge(out, lse, out_r, lse_r):
    """Two softmax partials over disjoint keys (out [nq, B, bq, K, G, D], lse [nq, B, K, G, bq], -inf where
    no key was seen) -> the partial over their union."""
    total = jnp.logaddexp(lse, lse_r)
    base = jnp.where(total == -jnp.inf, 0.0, total)  # rows that have seen nothing keep weight 0, not NaN

    def weight(part):
        return jnp.moveaxis(jnp.exp(part - base), -1, 2)[..., None]

    return out * weight(lse) + out_r * weight(lse_r), total


def _pass(x: jax.Array, axis, shards: int) -> jax.Array:
    """x from every shard to the next one around the ring."""
    return jax.lax.ppermute(x, axis, [(j, (j + 1) % shards) for j in range(shards)])


def _ring_forward(q, q_slot, q_seg, k, v, kv_slot, kv_seg, scale, dtype, axis, shards):
    """Blocked local queries and keys (`attention.flash_forward`'s layout) -> (out, lse) over the keys of
    every shard. Each step sends the block on before computing with it, so the transfer can overlap the
    compute; the last send brings the blocks home and is not used."""
    def step(carry, _):
        block, out, lse = carry
        following = tuple(_pass(x, axis, shards) for x in block)
        k, v, kv_slot, kv_seg = block
        out_r, lse_r = flash_forward(q, k, v, q_slot, kv_slot, q_seg, kv_seg, scale, dtype)
        return (following, *_merge(out, lse, out_r, lse_r)), None

    num_blocks, batch, block, heads, groups, _ = q.shape
    init = ((k, v, kv_slot, kv_seg), jnp.zeros(q.shape, F32),
            jnp.full((num_blocks, batch, heads, groups, block), -jnp.inf, F32))
    (_, out, lse), _ = jax.lax.scan(step, init, None, length=shards)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _ring(q, q_slot, q_seg, k, v, kv_slot, kv_seg, scale, dtype, axis, shards):
    return _ring_forward(q, q_slot, q_seg, k, v, kv_slot, kv_seg, scale, dtype, axis, shards)[0]


def _ring_fwd(q, q_slot, q_seg, k, v, kv_slot, kv_seg, scale, dtype, axis, shards):
    out, lse = _ring_forward(q, q_slot, q_seg, k, v, kv_slot, kv_seg, scale, dtype, axis, shards)
    return out, (q, q_slot, q_seg, k, v, kv_slot, kv_seg, out, lse)


def _ring_bwd(scale, dtype, axis, shards, residuals, d_out):
    q, q_slot, q_seg, k, v, kv_slot, kv_seg, out, lse = residuals

    def step(carry, _):
        d_q, (k, v, kv_slot, kv_seg, d_k, d_v) = carry
        following = tuple(_pass(x, axis, shards) for x in (k, v, kv_slot, kv_seg))
        dq, dk, dv = flash_gradients(q, k, v, q_slot, kv_slot, q_seg, kv_seg, out, lse, d_out, scale, dtype)
        d_k, d_v = _pass(d_k + dk, axis, shards), _pass(d_v + dv, axis, shards)
        return (d_q + dq, (*following, d_k, d_v)), None

    init = (jnp.zeros(q.shape, F32), (k, v, kv_slot, kv_seg, jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)))
    (d_q, (*_, d_k, d_v)), _ = jax.lax.scan(step, init, None, length=shards)
    return d_q.astype(q.dtype), None, None, d_k.astype(k.dtype), d_v.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ring_local(q, k, v, q_slot, kv_slot, q_seg, kv_seg, *, scale, dtype, block_size, axis, shards):
    """One device's part: its two chunks (`[B, 2c, ...]`) blocked separately, so that no block straddles
    them and the block skipping sees each chunk's own positions."""
    chunk = q.shape[1] // 2
    block = balanced_block(chunk, block_size)

    def blocked(fn, *xs):  # the blocks of the first chunk, then those of the second
        parts = [fn(*(x[:, half * chunk:(half + 1) * chunk] for x in xs), block) for half in (0, 1)]
        return tuple(jnp.concatenate(pair, axis=0) for pair in zip(*parts, strict=True))

    queries, keys = blocked(blocked_queries, q, q_slot, q_seg), blocked(blocked_keys, k, v, kv_slot, kv_seg)
    out = _ring(*queries, *keys, scale, dtype, axis, shards)
    first, second = jnp.split(out, 2, axis=0)
    return jnp.concatenate([unblocked(first, chunk), unblocked(second, chunk)], axis=1)


def ring_attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, plan: Plan, impl: str,
                   scale: float, dtype, block_size: int) -> jax.Array:
    """`jaxrl.models.attention.attention` of the full forward with T sharded over `plan` in its zig-zag
    layout: same arguments (q `[B, T, K, G, D]`, k/v `[B, T, K, D]`, slots and segment ids `[B, T]`, the
    slots being the row positions of the columns) and result (`[B, T, K, G, D]` float32).

    The local block runs the chunked kernel's pieces (blocks of at most `block_size`) whatever `impl`
    names: the merge needs each block's logsumexp, which the other kernels do not return.
    """
    del impl
    batch, length, kv_heads = k.shape[:3]
    token_spec = logical_to_spec(TOKEN_AXES, (batch, length, kv_heads), jax.sharding.get_abstract_mesh())
    row_spec = PartitionSpec(*token_spec[:2])
    local = functools.partial(_ring_local, scale=float(scale), dtype=dtype, block_size=block_size,
                              axis=plan.sequence_axes, shards=plan.shards)
    return jax.shard_map(local, in_specs=(token_spec,) * 3 + (row_spec,) * 4, out_specs=token_spec,
                         check_vma=False)(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids)
