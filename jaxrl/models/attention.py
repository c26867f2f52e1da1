"""Softmax attention kernels: pure functions, arrays in and out (docs/models.md#attention-implementations).

Shapes: ``B`` rows, ``T`` queries, ``S`` keys (the sequence, or the rows of a KV cache), ``K`` key/value
heads, ``G`` query heads per key/value head (grouped-query attention), head size ``D``.

Every implementation computes the same function. With
``q [B, T, K, G, D]``, ``k, v [B, S, K, D]``, integer ``q_slot``, ``q_segment_ids`` ``[B, T]`` and
``kv_slot``, ``kv_segment_ids`` ``[B, S]``:

    visible[b, t, s] = kv_slot[b, s] <= q_slot[b, t]  and  kv_segment_ids[b, s] in {q_segment_ids[b, t],
                                                                                 prefix_of(q_segment_ids[b, t])}
    score[b, k, g, t, s] = scale * q[b, t, k, g] . k[b, s, k]                     (float32)
    p = softmax over the visible s of score                                         (float32)
    out[b, t, k, g] = sum_s p[b, k, g, t, s] * v[b, s, k]                           ([B, T, K, G, D] float32)

and ``out = 0`` (zero gradients) on a row with no visible key. Segment id 0 is padding, compared like
any other id: padding never attends to or is attended by real tokens, and a padded query attends to
the padding keys before it (its output is never used). A segment id at or above ``TAIL_BASE`` marks a
*tail*: a sequence that continues a shared prefix (``jaxrl.models.packing``, a GRPO group's prompt laid
out once for all its samples); its queries also see the keys of the prefix's segment, ``prefix_of(id)``.
Any other id is its own prefix, so rows without tails get plain segment equality. The full forward
passes ``q_slot = kv_slot = arange(T)``; decoding with a KV cache passes ``q_slot = write_index + arange(T)``
and ``kv_slot = arange(S)`` (T = 1 per step, T = prompt length for a prefill).

Matmul inputs are in the compute ``dtype`` (the probabilities are cast to it before the value matmul),
accumulation and the softmax are float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl.errors import InputError
from jaxrl.models.config import ATTENTION_IMPL_NAMES
from jaxrl.models.cudnn import DTYPES as CUDNN_DTYPES
from jaxrl.models.cudnn import cudnn_attention
from jaxrl.models.sharding import target_platform
from jaxrl.models.splash import splash_attention

F32 = jnp.float32
_INT_MIN, _INT_MAX = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max
# Slots of the internal padding: a padded query sees no key, a padded key is seen by no query.
_Q_PAD_SLOT, _KV_PAD_SLOT = _INT_MIN, _INT_MAX


def _at(x, i):
    """x[i] along the leading (block) axis, as a dynamic slice."""
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


# Tail segment ids: TAIL_BASE + (prefix segment << TAIL_BITS) + tail number (1 ..), so a row holds up to
# 2^(30 - TAIL_BITS) - 1 segments and a prefix up to 2^TAIL_BITS - 1 tails, all within int32.
TAIL_BASE, TAIL_BITS = 1 << 30, 12


def tail_segment(prefix: int, tail: int) -> int:
    """The segment id of tail number ``tail`` (1 ..) of the prefix whose segment id is ``prefix``."""
    if not (0 < prefix < 1 << (30 - TAIL_BITS) and 0 < tail < 1 << TAIL_BITS):
        raise ValueError(f"tail {tail} of prefix segment {prefix}: a row holds at most {(1 << (30 - TAIL_BITS)) - 1} "
                         f"segments and a prefix at most {(1 << TAIL_BITS) - 1} tails")
    return TAIL_BASE + (prefix << TAIL_BITS) + tail


def prefix_of(segment_ids):
    """The segment whose keys a query of ``segment_ids`` sees besides its own: a tail's prefix, else itself."""
    return jnp.where(segment_ids >= TAIL_BASE, (segment_ids - TAIL_BASE) >> TAIL_BITS, segment_ids)


def visibility(q_slot, kv_slot, q_segment_ids, kv_segment_ids) -> jax.Array:
    """[B, T, S] bool: key s is visible to query t (causal in slots; the query's segment or its prefix)."""
    kv = kv_segment_ids[:, None, :]
    return ((kv_slot[:, None, :] <= q_slot[:, :, None])
            & ((kv == q_segment_ids[:, :, None]) | (kv == prefix_of(q_segment_ids)[:, :, None])))


def xla_attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, scale: float, dtype) -> jax.Array:
    """Attention with the full score tensor (memory O(T S)): XLA fuses the einsums, the mask and the softmax.

    q [B, T, K, G, D], k/v [B, S, K, D], slots and segment ids [B, T] / [B, S] -> [B, T, K, G, D] float32.
    ``scores [B, K, G, T, S] = scale * q k^T`` in float32, masked to ``finfo(float32).min``, softmax in
    float32, probabilities cast to ``dtype`` for ``probs @ v``; rows with no visible key give 0.
    """
    mask = visibility(q_slot, kv_slot, q_segment_ids, kv_segment_ids)
    if q.shape[1] == 1:  # a decode step
        return _one_query_attention(q, k, v, mask, scale=scale, dtype=dtype)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=F32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(dtype), preferred_element_type=F32)
    return jnp.where(jnp.any(mask, axis=-1)[:, :, None, None, None], out, 0.0)


def _one_query_attention(q, k, v, mask, *, scale: float, dtype) -> jax.Array:
    """`xla_attention` for one query per row (q [B, 1, K, G, D], mask [B, 1, S]) as broadcast products
    summed over D and then S: they read the KV cache in its stored [B, S, K, D] layout, where the two
    dot_generals make XLA transpose the whole cache of every layer at every decode step (on CPU the
    generation of bench/vs_tunix.py's large shape took 82 ms with them, 76 ms without). As the einsums:
    inputs in the compute dtype, their products and sums in float32."""
    def wide(x):  # a compute-dtype value, exactly in float32
        return x.astype(dtype).astype(F32)

    scores = jnp.sum(wide(q[:, 0, None]) * wide(k[:, :, :, None]), axis=-1) * scale  # [B, S, K, G]
    scores = jnp.where(mask[:, 0, :, None, None], scores, jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=1)
    out = jnp.sum(wide(probs[..., None]) * wide(v[:, :, :, None]), axis=1)[:, None]  # [B, 1, K, G, D]
    return jnp.where(jnp.any(mask, axis=-1)[:, :, None, None, None], out, 0.0)


# ---- chunked (FlashAttention-2 style) -----------------------------------------------------------------


def balanced_block(length: int, block: int) -> int:
    """Balanced blocks of at most `block`: ceil(length / ceil(length / block)), rounded up to a multiple of 8
    when >= 8 and that stays <= block, so the internal padding is small (length 700, block 512: 2 x 352,
    not 1024 rows; a one-token decode step stays one row)."""
    size = -(-length // -(-length // block))
    rounded = -(-size // 8) * 8
    return rounded if size >= 8 and rounded <= block else size


def _block_visibility(q_slot, q_seg, kv_slot, kv_seg):
    """Which (query block, key block) pairs may hold a visible pair, from per-block summaries.

    q_slot, q_seg [nq, B, bq]; kv_slot, kv_seg [nk, B, bk] (padding marked by the pad slots). Block
    (i, j) may see something in row b when the first key slot is <= the last query slot and the
    key block's segment-id range overlaps the query block's, or the range of its queries' prefixes
    (shared-prefix tails): conservative (a block it keeps may still be fully masked,
    the mask inside handles that) and O(B nq nk), never O(B T S). Returns (visible [nq, nk] bool,
    any batch row), and per query block the first / one-past-last visible key block, per key block
    the first / one-past-last query block that sees it (0, 0 when none), all int32.
    """
    q_valid, kv_valid = q_slot != _Q_PAD_SLOT, kv_slot != _KV_PAD_SLOT
    q_last = jnp.max(q_slot, axis=-1)  # [nq, B]; a fully padded block gives INT_MIN
    kv_first = jnp.min(kv_slot, axis=-1)  # [nk, B]; a fully padded block gives INT_MAX
    kv_lo = jnp.min(jnp.where(kv_valid, kv_seg, _INT_MAX), axis=-1)
    kv_hi = jnp.max(jnp.where(kv_valid, kv_seg, _INT_MIN), axis=-1)

    def overlaps(seg):  # [nq, nk, B]: the queries' ids `seg` span a range that meets the key block's
        lo = jnp.min(jnp.where(q_valid, seg, _INT_MAX), axis=-1)
        hi = jnp.max(jnp.where(q_valid, seg, _INT_MIN), axis=-1)
        return (lo[:, None] <= kv_hi[None]) & (kv_lo[None] <= hi[:, None])

    segments = overlaps(q_seg) | overlaps(prefix_of(q_seg))
    visible = jnp.any((kv_first[None] <= q_last[:, None]) & segments, axis=-1)  # [nq, nk]

    def bounds(vis):  # [n, m] -> first and one-past-last True of each row
        seen = jnp.any(vis, axis=-1)
        first = jnp.argmax(vis, axis=-1)
        stop = vis.shape[-1] - jnp.argmax(vis[:, ::-1], axis=-1)
        return jnp.where(seen, first, 0).astype(jnp.int32), jnp.where(seen, stop, 0).astype(jnp.int32)

    return visible, bounds(visible), bounds(visible.T)


def _block_scores(qi, kj, qs, ks, qseg, kseg, scale):
    """qi [B, bq, K, G, D], kj [B, bk, K, D] -> (masked scores [B, K, G, bq, bk] f32 (-inf where
    masked), mask [B, 1, 1, bq, bk])."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=F32) * scale
    mask = visibility(qs, ks, qseg, kseg)[:, None, None]
    return jnp.where(mask, s, -jnp.inf), mask


def flash_forward(q, k, v, q_slot, kv_slot, q_seg, kv_seg, scale, dtype):
    """Blocked inputs (q [nq, B, bq, K, G, D], k/v [nk, B, bk, K, D], slots/segments [n, B, b]) ->
    (out [nq, B, bq, K, G, D] f32, lse [nq, B, K, G, bq] f32: log sum exp of the visible scores, -inf on
    rows that see nothing). Online softmax over the key blocks a query block can see."""
    visible, (k_first, k_stop), _ = _block_visibility(q_slot, q_seg, kv_slot, kv_seg)
    _, batch, bq, heads, groups, dim = q.shape

    def query_block(xs):
        qi, qs, qseg, vis, first, stop = xs

        def step(j, carry):
            def compute(carry):
                m, total, acc = carry
                s, _ = _block_scores(qi, _at(k, j), qs, _at(kv_slot, j), qseg, _at(kv_seg, j), scale)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no NaN from (-inf) - (-inf)
                p = jnp.exp(s - m_safe[..., None])  # masked -> 0
                correction = jnp.exp(m - m_safe)  # m = -inf (nothing seen yet) -> 0
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(dtype), _at(v, j).astype(dtype),
                                preferred_element_type=F32)
                return m_new, total * correction + jnp.sum(p, axis=-1), acc * correction[..., None] + pv

            return jax.lax.cond(_at(vis, j), compute, lambda c: c, carry)

        init = (jnp.full((batch, heads, groups, bq), -jnp.inf, F32), jnp.zeros((batch, heads, groups, bq), F32),
                jnp.zeros((batch, heads, groups, bq, dim), F32))
        m, total, acc = jax.lax.fori_loop(first, stop, step, init)
        seen = total > 0
        total = jnp.where(seen, total, 1.0)
        out = jnp.where(seen[..., None], acc / total[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(total), -jnp.inf)
        return out.transpose(0, 3, 1, 2, 4), lse

    return jax.lax.map(query_block, (q, q_slot, q_seg, visible, k_first, k_stop))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, q_slot, kv_slot, q_seg, kv_seg, scale, dtype):
    return flash_forward(q, k, v, q_slot, kv_slot, q_seg, kv_seg, scale, dtype)[0]


def _flash_fwd(q, k, v, q_slot, kv_slot, q_seg, kv_seg, scale, dtype):
    out, lse = flash_forward(q, k, v, q_slot, kv_slot, q_seg, kv_seg, scale, dtype)
    return out, (q, k, v, q_slot, kv_slot, q_seg, kv_seg, out, lse)


def flash_gradients(q, k, v, q_slot, kv_slot, q_seg, kv_seg, out, lse, d_out, scale, dtype):
    """(dQ, dK, dV) float32 of blocked attention (shapes as `flash_forward`) given the output `out` and
    logsumexp `lse` of the queries over all their keys, which may be more than `k` holds (ring attention
    passes one block of keys at a time with the global `out` and `lse`).

    Recomputes each visible block's probabilities ``p = exp(s - lse)``; with ``delta = rowsum(dO * O)``:
    ``dV += p^T dO``, ``dP = dO V^T``, ``dS = p (dP - delta)``, ``dQ += scale dS K``, ``dK += scale dS^T Q``.
    Key blocks outside (their dK, dV accumulate in float32 and are written once), the query blocks
    that see each key block inside; dQ [nq, B, bq, K, G, D] float32 is carried through."""
    visible, _, (q_first, q_stop) = _block_visibility(q_slot, q_seg, kv_slot, kv_seg)
    d_out = d_out.astype(F32)
    delta = jnp.sum(d_out * out, axis=-1).transpose(0, 1, 3, 4, 2)  # [nq, B, K, G, bq]
    d_out_c = d_out.astype(dtype)

    def key_block(d_q, xs):
        kj, vj, ks, kseg, vis, first, stop = xs

        def step(i, carry):
            def compute(_):
                qi, d_out_i = _at(q, i), _at(d_out_c, i)
                s, mask = _block_scores(qi, kj, _at(q_slot, i), ks, _at(q_seg, i), kseg, scale)
                p = jnp.where(mask, jnp.exp(s - _at(lse, i)[..., None]), 0.0)  # [B, K, G, bq, bk]
                dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dtype), d_out_i, preferred_element_type=F32)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", d_out_i, vj.astype(dtype), preferred_element_type=F32)
                ds = (p * (dp - _at(delta, i)[..., None])).astype(dtype)
                dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=F32) * scale
                dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=F32) * scale
                return dq, dk, dv

            def skip(_):
                return (jnp.zeros(q.shape[1:], F32), jnp.zeros(kj.shape, F32), jnp.zeros(vj.shape, F32))

            d_q, d_k, d_v = carry
            dq, dk, dv = jax.lax.cond(_at(vis, i), compute, skip, None)
            d_q = jax.lax.dynamic_update_index_in_dim(d_q, _at(d_q, i) + dq, i, 0)
            return d_q, d_k + dk, d_v + dv

        init = (d_q, jnp.zeros(kj.shape, F32), jnp.zeros(vj.shape, F32))
        d_q, d_k, d_v = jax.lax.fori_loop(first, stop, step, init)
        return d_q, (d_k, d_v)

    xs = (k, v, kv_slot, kv_seg, visible.T, q_first, q_stop)
    d_q, (d_k, d_v) = jax.lax.scan(key_block, jnp.zeros(q.shape, F32), xs)
    return d_q, d_k, d_v


def _flash_bwd(scale, dtype, residuals, d_out):
    d_q, d_k, d_v = flash_gradients(*residuals, d_out, scale, dtype)
    q, k, v = residuals[:3]
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def chunked_attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, scale: float, dtype,
                      block_q: int = 512, block_k: int = 512) -> jax.Array:
    """Blockwise attention with an online softmax and a recomputing backward (FlashAttention-2 in XLA).

    Same arguments and result as `xla_attention` (q [B, T, K, G, D], k/v [B, S, K, D] -> [B, T, K, G, D]
    float32). Queries go in blocks of at most `block_q`, keys in blocks of at most `block_k` (balanced
    sizes; T and S are padded internally with slots nobody sees). Per query block, a running max
    ``m``, sum ``l`` and accumulator ``acc`` (float32) are updated over key blocks:
    ``m' = max(m, max_s s)``, ``l' = l e^{m - m'} + sum_s e^{s - m'}``,
    ``acc' = acc e^{m - m'} + e^{s - m'} v``; ``out = acc / l``. A (query block, key block) pair that
    cannot hold a visible pair (from the blocks' slot and segment ranges: above the causal diagonal,
    other packed sequences, unwritten cache rows) is skipped: the key loop runs from the first to the
    last block the query block may see and `lax.cond` skips the others in between. A `custom_vjp`
    saves only the output and the per-row logsumexp and recomputes the probabilities block by
    block in the backward, so activation memory is O(T (D + block)) per head, never O(T S).
    Differentiable with respect to q, k and v (reverse mode only).
    """
    length = q.shape[1]
    bq, bk = balanced_block(length, block_q), balanced_block(k.shape[1], block_k)
    queries = blocked_queries(q, q_slot, q_segment_ids, bq)
    keys = blocked_keys(k, v, kv_slot, kv_segment_ids, bk)
    out = _flash(queries[0], *keys[:2], queries[1], keys[2], queries[2], keys[3], float(scale), dtype)
    return unblocked(out, length)


def _blocked(x, block: int, fill) -> jax.Array:
    """[B, L, ...] -> [ceil(L / block), B, block, ...], the end padded with `fill`."""
    x = jnp.pad(x, [(0, 0), (0, -x.shape[1] % block)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], -1, block, *x.shape[2:]), 1, 0)


def blocked_queries(q, q_slot, q_segment_ids, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, ...], slots and segment ids [B, T] -> the `flash_forward` layout, padded queries seeing no key."""
    return (_blocked(q, block, 0), _blocked(jnp.asarray(q_slot, jnp.int32), block, _Q_PAD_SLOT),
            _blocked(jnp.asarray(q_segment_ids, jnp.int32), block, 0))


def blocked_keys(k, v, kv_slot, kv_segment_ids, block: int) -> tuple[jax.Array, ...]:
    """k/v [B, S, ...], slots and segment ids [B, S] -> the `flash_forward` layout, padded keys seen by none."""
    return (_blocked(k, block, 0), _blocked(v, block, 0),
            _blocked(jnp.asarray(kv_slot, jnp.int32), block, _KV_PAD_SLOT),
            _blocked(jnp.asarray(kv_segment_ids, jnp.int32), block, 0))


def unblocked(out: jax.Array, length: int) -> jax.Array:
    """[n, B, block, ...] -> [B, length, ...]: the inverse of the blocking, padding dropped."""
    return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], -1, *out.shape[3:])[:, :length]


# ---- the switch -----------------------------------------------------------------------------------------

AttentionFn = Callable[..., jax.Array]


def _xla_impl(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, scale, dtype, block_size):
    del block_size
    return xla_attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, scale=scale, dtype=dtype)


def _chunked_impl(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, scale, dtype, block_size):
    return chunked_attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, scale=scale, dtype=dtype,
                             block_q=block_size, block_k=block_size)


# `ModelConfig.attention_impl` name (config.ATTENTION_IMPL_NAMES except "auto") -> implementation, called as
# `fn(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, scale, dtype, block_size)`.
ATTENTION_IMPLS: dict[str, AttentionFn] = {
    "xla": _xla_impl,
    "chunked": _chunked_impl,
    "splash": splash_attention,
    "cudnn": cudnn_attention,
}
# Kernels that serve the full forward only (queries = keys = the row's tokens in order); attention over a
# KV cache (decoding, a prefill into the cache) runs DECODE_IMPL instead.
FULL_FORWARD_ONLY = frozenset({"splash", "cudnn"})
DECODE_IMPL = "chunked"
# What "auto" means per target platform (`sharding.target_platform`); a platform not listed gets AUTO_DEFAULT.
AUTO_IMPLS: dict[str, str] = {"tpu": "splash", "gpu": "cudnn"}
AUTO_DEFAULT = "chunked"


def resolve_attention_impl(name: str, backend: str | None = None, *, length: int | None = None,
                           block_size: int | None = None, dtype=None) -> str:
    """The implementation `name` runs on `backend` (default: the mesh's platform, else jax's): "auto" ->
    AUTO_IMPLS / AUTO_DEFAULT, except that attention whose queries and keys fit in one block
    (`length <= block_size`) runs the xla einsum: a single block saves no memory, and short sequences
    keep the reference numerics; and that a compute `dtype` cuDNN does not take (float32) runs
    AUTO_DEFAULT on a GPU."""
    if name not in ATTENTION_IMPL_NAMES:
        raise ValueError(f"attention_impl = {name!r}; choose one of {list(ATTENTION_IMPL_NAMES)}")
    if name == "auto":
        if length is not None and block_size is not None and length <= block_size:
            return "xla"
        auto = AUTO_IMPLS.get(backend or target_platform(), AUTO_DEFAULT)
        if auto == "cudnn" and dtype is not None and jnp.dtype(dtype) not in CUDNN_DTYPES:
            return AUTO_DEFAULT
        return auto
    return name


def attention(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, *, impl: str = "auto", scale: float,
              dtype, block_size: int = 512, full_forward: bool = True) -> jax.Array:
    """Dispatch to `ATTENTION_IMPLS[resolve_attention_impl(impl)]` (`DECODE_IMPL` for a full-forward-only
    kernel over a KV cache: `full_forward=False`, or fewer queries than keys); shapes as `xla_attention`."""
    name = resolve_attention_impl(impl, length=max(q.shape[1], k.shape[1]), block_size=block_size, dtype=dtype)
    if name in FULL_FORWARD_ONLY and (not full_forward or q.shape[1] != k.shape[1]):
        name = DECODE_IMPL
    fn = ATTENTION_IMPLS[name]
    return fn(q, k, v, q_slot, kv_slot, q_segment_ids, kv_segment_ids, scale=scale, dtype=dtype,
              block_size=block_size)


def packed_rows_impl(impl: str, platform: str) -> str:
    """The attention implementation for packed rows (several sequences in a row) when the model's is
    ``impl`` on ``platform``: ``auto``, which would be cuDNN on a GPU, runs ``chunked``; an explicit
    ``cudnn``, which masks a row by its length, is refused (InputError naming the keys)."""
    if resolve_attention_impl(impl, platform) != "cudnn":
        return impl
    if impl == "cudnn":
        raise InputError("model.attention_impl: cudnn masks a row by its length, so it cannot keep the sequences "
                         "of a packed row apart; set update.pack (sft.pack) to false, or model.attention_impl to "
                         "auto (chunked for packed rows) or chunked")
    return AUTO_DEFAULT
