"""Context parallelism over the mesh axes of the "length" logical axis, Ulysses style
(docs/models.md#context-parallelism); the plan of ring attention's mode too (`jaxrl.models.ring` runs it:
softmax layers pass keys and values around the shards, the other token mixers run Ulysses here).

In the full forward, activations are sharded over those axes along T (the sequence shards, `s` of
them). A token mixer that needs the whole sequence (softmax attention, the linear-attention kernels)
runs inside `jax.shard_map`:

1. `all_to_all` over the sequence shards from sequence-sharded `[B, T/s, H_l, ...]` to head-sharded
   `[B, T, H_l/s, ...]` (each device splits its heads into s blocks, sends block j to shard j, and
   concatenates the T pieces it receives in shard order);
2. the unchanged full-sequence computation on those heads, with the `[B, T]` integer side inputs
   (slots, segment ids) all-gathered whole;
3. `all_to_all` back to `[B, T/s, H_l, ...]`.

Batch and heads keep the shardings of the logical rules ("batch", "act_heads": `H_l` is the heads
of one "act_heads" shard): `in_specs` / `out_specs` come from `logical_to_spec`, so no mesh axis is
named here. Gradients come from autodiff (the transpose of an all_to_all is the reverse all_to_all,
that of a tiled all_gather a reduce-scatter). The head axis is padded (zeros, dropped afterwards) to a
multiple of (heads shards x sequence shards) when it is not one already, and a device holding only
padding skips the computation; callers prefer regrouping (`kv_repeat`) so that no padding is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl.models.attention import attention
from jaxrl.models.config import CONTEXT_PARALLEL_NAMES
from jaxrl.models.sharding import logical_to_spec, spec_axes

TOKEN_AXES = ("batch", "length", "act_heads")  # per-token arrays [B, T, H, ...]


class Plan(NamedTuple):
    """How one full forward is split: `sequence_axes` shard T (`shards` ways in all), `head_axes`
    shard the heads; `head_shards` = heads shards x `shards`, what the head axis must be a multiple of.
    `ring`: softmax layers run ring attention (`jaxrl.models.ring`) and the row is in its zig-zag
    layout (`column_positions`); the other token mixers run Ulysses on it."""

    sequence_axes: tuple[str, ...]
    head_axes: tuple[str, ...]
    shards: int
    head_shards: int
    ring: bool = False


# How many chunks of a row each sequence shard holds, per mode: ring's zig-zag split gives each two.
CHUNKS_PER_SHARD = {"ring": 2}


def chunks_per_shard(mode: str) -> int:
    """The rows of `ModelConfig.context_parallel = mode` must be a multiple of this times the sequence shards."""
    return CHUNKS_PER_SHARD.get(mode, 1)


def plan(mode: str, batch: int, length: int) -> Plan | None:
    """The context-parallel plan for a `[batch, length]` full forward under the current mesh (`jax.set_mesh`),
    or None for the plain path. `mode` is `ModelConfig.context_parallel`: "none" -> None; "auto" -> a
    Ulysses plan when the mesh shards "length" more than one way (and evenly: else the plain path, where
    the partitioner handles it); "ulysses" -> a plan, or a ValueError when the mesh cannot shard T;
    "ring" -> a ring plan, or a ValueError unless the mesh shards T more than one way into
    `chunks_per_shard("ring")` chunks per shard."""
    if mode not in CONTEXT_PARALLEL_NAMES:
        raise ValueError(f"ModelConfig.context_parallel = {mode!r}; choose one of {list(CONTEXT_PARALLEL_NAMES)}")
    if mode == "none":
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        if mode != "auto":
            raise ValueError(f"ModelConfig.context_parallel = {mode!r} needs a mesh (jax.set_mesh) whose "
                             "'length' axes shard the sequence; use 'auto' or 'none' without one")
        return None
    chunks = chunks_per_shard(mode)
    # mesh.size is a multiple of every product of mesh axes, so the heads entry lists every axis it may use
    spec = logical_to_spec(TOKEN_AXES, (batch, length // chunks, mesh.size), mesh)
    sequence_axes, head_axes = spec_axes(spec[1]), spec_axes(spec[2])
    shards = math.prod(mesh.shape[a] for a in sequence_axes)
    wanted = spec_axes(logical_to_spec(("length",), mesh=mesh)[0])
    if mode != "auto" and (not wanted or sequence_axes != wanted or length % chunks):
        what = "the sequence length" if chunks == 1 else f"{chunks} chunks of the sequence length"
        raise ValueError(f"ModelConfig.context_parallel = {mode!r}: the mesh axes {wanted} of logical axis "
                         f"'length' must divide {what} {length}; pad the rows or change the mesh")
    if mode == "ring" and shards <= 1:
        raise ValueError("ModelConfig.context_parallel = 'ring' passes keys and values around the 'sequence' "
                         f"shards and needs mesh.sequence > 1 (the mesh axes {wanted} are of size {shards})")
    if mode == "auto" and (shards <= 1 or sequence_axes != wanted):
        return None
    return Plan(sequence_axes, head_axes, shards, shards * math.prod(mesh.shape[a] for a in head_axes),
                ring=mode == "ring")


def column_positions(plan: Plan | None, length: int) -> np.ndarray:
    """[length] int32: the position in the row of each column of the full forward's layout. Ring's
    zig-zag split (Brandon et al. 2023, https://arxiv.org/abs/2311.09431, and zig-zag ring attention):
    the row is cut into 2s chunks of length / 2s and shard j (of s) holds chunks j and 2s-1-j, so that
    every shard gets the same causal work; otherwise the row in order."""
    if plan is None or not plan.ring:
        return np.arange(length, dtype=np.int32)
    shards = plan.shards
    chunk = length // (2 * shards)
    chunks = np.stack([np.arange(shards), 2 * shards - 1 - np.arange(shards)], axis=1).reshape(-1)
    return (chunks[:, None] * chunk + np.arange(chunk)).reshape(-1).astype(np.int32)


def _pad_axis(x: jax.Array, pad: int, axis: int) -> jax.Array:
    """x with `pad` zeros appended along `axis`."""
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def kv_repeat(kv_heads: int, groups: int, multiple: int) -> int:
    """How many copies of each key/value head make `kv_heads * r` a multiple of `multiple`: the smallest
    divisor r of `groups` that does (each copy serves `groups / r` query heads), else `groups` (one copy
    per query head; the head axis is then padded)."""
    return next((r for r in range(1, groups + 1) if groups % r == 0 and kv_heads * r % multiple == 0), groups)


def ulysses(fn: Callable, per_token: Sequence[jax.Array], per_row: Sequence[jax.Array] = (),
            per_head: Sequence[jax.Array] = (), *, plan: Plan) -> tuple[jax.Array, ...]:
    """Run `fn` on whole sequences for a share of the heads.

    per_token: arrays `[B, T, H, ...]` (same B, T, H), sharded ("batch", "length", "act_heads");
    per_row: `[B, T]` arrays, gathered whole along T; per_head: `[H, ...]` arrays, each device getting
    the rows of its heads. The head axis is padded with zero heads to a multiple of `plan.head_shards`;
    a device whose share is padding only skips `fn` (its outputs are zeros, dropped).
    `fn(per_token, per_row, per_head)` sees `[B_l, T, h, ...]`, `[B_l, T]` and `[h, ...]` tuples
    (`h` = padded H / head_shards) and returns a tuple of `[B_l, T, h, ...]` arrays.
    Returns those outputs as `[B, T, H, ...]` arrays sharded like `per_token`.
    """
    batch, length, heads = per_token[0].shape[:3]
    pad = -heads % plan.head_shards
    share = (heads + pad) // plan.head_shards
    # a spec names the leading dimensions only: [B, T, H] of every per-token array, [H] of a per-head one
    token_spec = logical_to_spec(TOKEN_AXES, (batch, length, heads + pad), jax.sharding.get_abstract_mesh())
    if (spec_axes(token_spec[1]), spec_axes(token_spec[2])) != (plan.sequence_axes, plan.head_axes):
        raise ValueError(f"ulysses: arrays [{batch}, {length}, {heads}, ...] shard as {token_spec}, not as {plan}")
    head_order = plan.head_axes + plan.sequence_axes  # the heads shard, then the sequence shard
    axis = plan.sequence_axes

    # ring's zig-zag columns go back into row order for the kernels, which run along the sequence
    order = column_positions(plan, length)
    in_row_order = np.argsort(order) if plan.ring else None

    def local(tokens, rows, head_values):
        tokens = tuple(jax.lax.all_to_all(x, axis, 2, 1, tiled=True) for x in tokens)
        rows = tuple(jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in rows)
        if plan.ring:
            tokens, rows = (tuple(jnp.take(x, in_row_order, axis=1) for x in xs) for xs in (tokens, rows))
        args = (tokens, rows, tuple(head_values))
        if pad:
            padding_only = jax.lax.axis_index(head_order) * share >= heads
            zeros = jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype), jax.eval_shape(fn, *args))
            outs = jax.lax.cond(padding_only, lambda *_: zeros, fn, *args)
        else:
            outs = fn(*args)
        if plan.ring:
            outs = tuple(jnp.take(x, order, axis=1) for x in outs)
        return tuple(jax.lax.all_to_all(x, axis, 1, 2, tiled=True) for x in outs)

    outs = jax.shard_map(
        local, in_specs=(token_spec, PartitionSpec(*token_spec[:2]), PartitionSpec(head_order)),
        out_specs=token_spec,
        check_vma=False,  # the kernels' scan / cond carries start from zeros that vary over no mesh axis
    )(tuple(_pad_axis(x, pad, 2) for x in per_token), tuple(per_row), tuple(_pad_axis(x, pad, 0) for x in per_head))
    return tuple(x[:, :, :heads] for x in outs)


def ulysses_attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, plan: Plan, impl: str,
                      scale: float, dtype, block_size: int) -> jax.Array:
    """`jaxrl.models.attention.attention` with T sharded over `plan`: same arguments (q `[B, T, K, G, D]`,
    k/v `[B, T, K, D]`, slots and segment ids `[B, T]`) and result (`[B, T, K, G, D]` float32).

    Grouped-query attention: the heads split over the sequence shards are key/value heads, each
    repeated `kv_repeat` times (copy i serving query groups i*G/r .. (i+1)*G/r - 1) so that the
    shards divide them; a device then holds exactly the key/value heads its query heads read.
    """
    batch, length, kv_heads, groups, dim = q.shape
    repeat = kv_repeat(kv_heads, groups, plan.head_shards)
    q = q.reshape(batch, length, kv_heads * repeat, groups // repeat, dim)
    k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))

    def local(tokens, rows, _):
        return (attention(*tokens, *rows, impl=impl, scale=scale, dtype=dtype, block_size=block_size),)

    (out,) = ulysses(local, (q, k, v), (q_slot, kv_slot, q_segment_ids, kv_segment_ids), plan=plan)
    return out.reshape(batch, length, kv_heads, groups, dim)
