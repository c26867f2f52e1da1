"""The chunked LM head: target-token logprobs and token entropy from hidden states (docs/models.md#chunked-lm-head).

Shapes: ``B`` sequences of ``T`` positions, hidden size ``D``, vocabulary ``V``.
Every statistic is computed in float32 whatever the input dtype.

The LM head is the largest activation in RL post-training: ``[B, T, V]``
float32 logits for ``T = 8192`` and ``V = 151,936`` are 5 GB per sequence, and
autodiff keeps several of them alive. :func:`token_logprobs_and_entropy`
computes the two per-token statistics the losses need straight from the hidden
states and the LM-head weight, one ``[chunk_size, vocab_chunk_size]`` tile at a
time, and recomputes each tile in the backward pass (the Liger idea used by
Motif), so no ``[B, T, V]`` array is ever held.

On a mesh, :func:`sharded_token_logprobs_and_entropy` runs it per device on the device's own
tokens (``jax.shard_map`` over the ``batch`` and ``length`` logical axes): left to XLA's
partitioner, the token-chunk loop indexes a sharded axis, so every device gathered the whole
batch's hidden states and computed the head for all of it (measured: 8 devices each looping over
all 64 chunks of an ``[8, 8192]`` batch instead of their 8). The head weight stays split by rows
over those devices: each vocabulary tile is gathered as the loop reaches it and its gradient
reduce-scattered as the backward loop leaves it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl.models.sharding import logical_to_spec, spec_axes

__all__ = ["sharded_token_logprobs_and_entropy", "token_logprobs_and_entropy"]


def _check_array(name, x, rank, kind):
    """Raises a ValueError naming ``name`` unless ``x`` has rank ``rank`` (None: any) and a dtype of ``kind``."""
    if rank is not None and jnp.ndim(x) != rank:
        raise ValueError(f"{name} has rank {jnp.ndim(x)} (shape {jnp.shape(x)}) but rank {rank} was expected")
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, kind):
        label, cast = ("a floating", "jnp.float32") if kind is jnp.floating else ("an integer", "jnp.int32")
        raise ValueError(f"{name} has dtype {dtype} but {label} dtype was expected; cast it with .astype({cast})")


def _vocab_tile(lm_head, bias, tile_index, vocab_chunk, compute_dtype, gather_axes):
    """Columns of tile ``tile_index``: (first column, weight [D, vc] in ``compute_dtype``, bias [vc] f32 or
    None, col ids, valid).

    The last tile is clamped to end at ``V`` instead of padding the weight (a
    padded copy of a 150k-column head would cost as much as the head); its
    columns that the previous tile already covered are marked invalid. With
    ``gather_axes`` (inside ``shard_map``) ``lm_head`` is this device's ``[D / n, V]``
    rows and the tile's rows are gathered from the ``n`` devices of those mesh axes,
    already in ``compute_dtype``.
    """
    vocab = lm_head.shape[1]
    start = jnp.minimum(tile_index * vocab_chunk, vocab - vocab_chunk)
    weight = jax.lax.dynamic_slice_in_dim(lm_head, start, vocab_chunk, axis=1).astype(compute_dtype)
    if gather_axes:
        weight = jax.lax.all_gather(weight, gather_axes, axis=0, tiled=True)
    tile_bias = None
    if bias is not None:
        tile_bias = jax.lax.dynamic_slice_in_dim(bias, start, vocab_chunk).astype(jnp.float32)
    cols = start + jnp.arange(vocab_chunk)
    valid = cols >= tile_index * vocab_chunk
    return start, weight, tile_bias, cols, valid


def _tile_logits(h, weight, tile_bias):
    """[c, D] x [D, vc] -> [c, vc] float32 logits (inputs in their dtype, f32 accumulation)."""
    z = jax.lax.dot_general(h, weight, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return z if tile_bias is None else z + tile_bias


def _head_forward(hidden, lm_head, bias, targets, vocab_chunk, compute_dtype, gather_axes):
    """Online logsumexp over vocab tiles. Returns (logp, entropy, lse), each [nc, c] f32.

    Per token it keeps the running max ``m``, ``s = sum exp(z - m)``,
    ``t = sum exp(z - m) (z - m)`` and the target logit; then
    ``lse = m + log s`` and ``H = log s - t / s`` (no cancellation of two large
    numbers, unlike ``lse - E[z]``).
    """
    num_chunks, chunk = targets.shape
    num_tiles = -(-lm_head.shape[1] // vocab_chunk)
    f32 = jnp.float32

    def vocab_step(j, carry):
        m, s, t, z_target = carry
        _, weight, tile_bias, cols, valid = _vocab_tile(lm_head, bias, j, vocab_chunk, compute_dtype, gather_axes)

        def token_step(i, inner):
            m, s, t, z_target = inner
            z = _tile_logits(hidden[i], weight, tile_bias)
            z = jnp.where(valid, z, -jnp.inf)
            m_old = m[i]
            m_new = jnp.maximum(m_old, jnp.max(z, axis=-1))
            # Rescale the old sums to the new max; before the first tile s = 0.
            shift = jnp.where(s[i] > 0, m_old - m_new, 0.0)
            scale = jnp.exp(shift)
            e = jnp.exp(z - m_new[:, None])
            z_centered = jnp.where(valid, z - m_new[:, None], 0.0)
            s_new = s[i] * scale + jnp.sum(e, axis=-1)
            t_new = scale * (t[i] + shift * s[i]) + jnp.sum(e * z_centered, axis=-1)
            hit = valid & (cols == targets[i][:, None])
            zt_new = z_target[i] + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
            return m.at[i].set(m_new), s.at[i].set(s_new), t.at[i].set(t_new), z_target.at[i].set(zt_new)

        return jax.lax.fori_loop(0, num_chunks, token_step, carry)

    init = (jnp.full((num_chunks, chunk), -jnp.inf, f32), jnp.zeros((num_chunks, chunk), f32),
            jnp.zeros((num_chunks, chunk), f32), jnp.zeros((num_chunks, chunk), f32))
    m, s, t, z_target = jax.lax.fori_loop(0, num_tiles, vocab_step, init)
    log_s = jnp.log(s)
    lse = m + log_s
    return z_target - lse, log_s - t / s, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked_head(hidden, lm_head, bias, targets, vocab_chunk, compute_dtype, gather_axes):
    logp, entropy, _ = _head_forward(hidden, lm_head, bias, targets, vocab_chunk, compute_dtype, gather_axes)
    return logp, entropy


def _chunked_head_fwd(hidden, lm_head, bias, targets, vocab_chunk, compute_dtype, gather_axes):
    logp, entropy, lse = _head_forward(hidden, lm_head, bias, targets, vocab_chunk, compute_dtype, gather_axes)
    return (logp, entropy), (hidden, lm_head, bias, targets, lse, entropy)


def _chunked_head_bwd(vocab_chunk, compute_dtype, gather_axes, residuals, cotangents):
    """Recomputes each tile's logits; d logp/dz = onehot - p, dH/dz = -p (log p + H).

    Vocab tiles outside, token chunks inside: the weight gradient of a tile is
    accumulated in float32 over all tokens and written once in ``lm_head``'s own
    dtype (a float32 parameter's gradient is never rounded to the compute dtype);
    the hidden gradient [N, D] is accumulated in float32. With ``gather_axes`` each
    tile's weight gradient is summed over those devices and scattered back to the
    rows each holds (a reduce-scatter per tile), so no device holds a whole
    ``[D, V]`` gradient.
    """
    hidden, lm_head, bias, targets, lse, entropy = residuals
    g_logp, g_entropy = cotangents
    num_chunks = targets.shape[0]
    num_tiles = -(-lm_head.shape[1] // vocab_chunk)
    f32 = jnp.float32

    def vocab_step(j, carry):
        d_hidden, d_head, d_bias = carry
        start, weight, tile_bias, cols, valid = _vocab_tile(lm_head, bias, j, vocab_chunk, compute_dtype,
                                                            gather_axes)
        weight_f32 = weight.astype(f32)

        def token_step(i, inner):
            d_hidden, d_weight, d_tile_bias = inner
            z = _tile_logits(hidden[i], weight, tile_bias)
            log_p = z - lse[i][:, None]
            p = jnp.where(valid, jnp.exp(log_p), 0.0)
            onehot = (valid & (cols == targets[i][:, None])).astype(f32)
            dz = (g_logp[i][:, None] * (onehot - p)
                  - g_entropy[i][:, None] * p * (log_p + entropy[i][:, None]))
            dz = jnp.where(valid, dz, 0.0)
            d_hidden = d_hidden.at[i].add(dz @ weight_f32.T)
            d_weight = d_weight + hidden[i].astype(f32).T @ dz
            return d_hidden, d_weight, d_tile_bias + jnp.sum(dz, axis=0)

        tile_init = (d_hidden, jnp.zeros(weight.shape, f32), jnp.zeros((vocab_chunk,), f32))
        d_hidden, d_weight, d_tile_bias = jax.lax.fori_loop(0, num_chunks, token_step, tile_init)
        if gather_axes:
            d_weight = jax.lax.psum_scatter(d_weight, gather_axes, scatter_dimension=0, tiled=True)
        # Keep the columns an earlier (overlapping) tile already wrote.
        old = jax.lax.dynamic_slice_in_dim(d_head, start, vocab_chunk, axis=1)
        d_weight = jnp.where(valid, d_weight.astype(d_head.dtype), old)
        d_head = jax.lax.dynamic_update_slice_in_dim(d_head, d_weight, start, axis=1)
        if d_bias is not None:
            old_b = jax.lax.dynamic_slice_in_dim(d_bias, start, vocab_chunk)
            d_bias = jax.lax.dynamic_update_slice_in_dim(
                d_bias, jnp.where(valid, d_tile_bias.astype(d_bias.dtype), old_b), start, axis=0)
        return d_hidden, d_head, d_bias

    init = (jnp.zeros(hidden.shape, f32), jnp.zeros_like(lm_head),
            None if bias is None else jnp.zeros_like(bias))
    d_hidden, d_head, d_bias = jax.lax.fori_loop(0, num_tiles, vocab_step, init)
    return d_hidden.astype(hidden.dtype), d_head, d_bias, None


_chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd)


def _check_inputs(hidden, lm_head, targets, bias, chunk_size, vocab_chunk_size):
    """Errors naming the argument for what :func:`token_logprobs_and_entropy` cannot take."""
    _check_array("hidden", hidden, 3, jnp.floating)
    _check_array("lm_head", lm_head, 2, jnp.floating)
    _check_array("targets", targets, None, jnp.integer)
    batch, length, dim = hidden.shape
    if lm_head.shape[0] != dim:
        raise ValueError(
            f"lm_head has shape {lm_head.shape} but hidden has hidden size {dim}; "
            f"expected lm_head of shape [{dim}, V] (transpose an [V, D] embedding table)"
        )
    if targets.shape != (batch, length):
        raise ValueError(
            f"targets has shape {targets.shape} but hidden has shape {hidden.shape}; "
            f"expected targets of shape {(batch, length)}"
        )
    vocab = lm_head.shape[1]
    if bias is not None:
        _check_array("bias", bias, None, jnp.floating)
        if bias.shape != (vocab,):
            raise ValueError(f"bias has shape {bias.shape} but shape {(vocab,)} was expected")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r} but a positive integer was expected")
    if vocab_chunk_size is not None and (not isinstance(vocab_chunk_size, int) or vocab_chunk_size <= 0):
        raise ValueError(
            f"vocab_chunk_size={vocab_chunk_size!r} but a positive integer or None was expected")


def token_logprobs_and_entropy(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = 1024,
    vocab_chunk_size: int | None = 16384,
    bias: jax.Array | None = None,
    compute_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Target-token logprobs and token entropy from hidden states, tile by tile.

    ``z = hidden @ lm_head (+ bias)``; ``logp = z_y - logsumexp(z)``,
    ``H = -sum softmax(z) log softmax(z)`` (docs/models.md#chunked-lm-head), never materialising
    ``[B, T, V]``: tokens go in chunks of ``chunk_size`` and the vocabulary in
    tiles of ``vocab_chunk_size`` with an online logsumexp. The backward pass
    (a ``custom_vjp``) recomputes each tile, so the peak extra memory is a few
    ``[chunk_size, vocab_chunk_size]`` float32 tiles plus the gradients.
    Neither size needs to divide ``B*T`` or ``V`` (tokens are padded, the last
    vocab tile is clamped and its overlap masked). Matmuls take the inputs in
    their own dtype (e.g. bfloat16) and accumulate in float32.

    Args:
      hidden: ``[B, T, D]`` float, final hidden states (after the last norm).
      lm_head: ``[D, V]`` float, the LM-head (unembedding) weight.
      targets: ``[B, T]`` integer, the token whose logprob is wanted at each position.
      chunk_size: tokens per chunk.
      vocab_chunk_size: vocabulary columns per tile; ``None`` for the whole vocabulary.
      bias: optional ``[V]`` float LM-head bias.
      compute_dtype: the dtype the matmuls take the head in (e.g. bfloat16; ``None``: ``lm_head``'s own);
        each tile is cast as it is sliced, so ``lm_head``'s gradient stays in its own dtype.
    Returns:
      ``(logp, entropy)``, each ``[B, T]`` float32. Differentiable w.r.t.
      ``hidden``, ``lm_head`` and ``bias`` (reverse mode; gradients come back in
      the inputs' dtypes).
    """
    _check_inputs(hidden, lm_head, targets, bias, chunk_size, vocab_chunk_size)
    return _token_head(hidden, lm_head, targets, bias, chunk_size, vocab_chunk_size, compute_dtype, ())


def _token_head(hidden, lm_head, targets, bias, chunk_size, vocab_chunk_size, compute_dtype, gather_axes):
    """:func:`token_logprobs_and_entropy` on checked inputs; ``gather_axes`` as in :func:`_vocab_tile`."""
    batch, length, dim = hidden.shape
    vocab = lm_head.shape[1]
    num_tokens = batch * length
    chunk = min(chunk_size, num_tokens)
    vocab_chunk = vocab if vocab_chunk_size is None else min(vocab_chunk_size, vocab)
    pad = -num_tokens % chunk
    h = jnp.pad(hidden.reshape(num_tokens, dim), ((0, pad), (0, 0)))
    y = jnp.pad(targets.reshape(num_tokens).astype(jnp.int32), (0, pad))
    logp, entropy = _chunked_head(h.reshape(-1, chunk, dim), lm_head, bias,
                                  y.reshape(-1, chunk), vocab_chunk,
                                  lm_head.dtype if compute_dtype is None else compute_dtype, gather_axes)
    unpad = lambda x: x.reshape(-1)[:num_tokens].reshape(batch, length)
    return unpad(logp), unpad(entropy)


def sharded_token_logprobs_and_entropy(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *,
                                       chunk_size: int = 1024, vocab_chunk_size: int | None = 16384,
                                       bias: jax.Array | None = None,
                                       compute_dtype=None) -> tuple[jax.Array, jax.Array]:
    """:func:`token_logprobs_and_entropy` on each device's own tokens under the current mesh.

    ``hidden`` ``[B, T, D]`` and ``targets`` ``[B, T]`` are split as the ``batch`` and ``length``
    logical axes are (``jaxrl.models.sharding``: rows over the data axes, a row's tokens over
    ``sequence`` under context parallelism), and each device runs the chunked head on its
    ``[B / b, T / s]`` tokens. The LM head ``[D, V]`` comes in split by rows over the same ``n``
    devices (when ``n`` divides ``D``; otherwise whole): each vocabulary tile is gathered in
    ``compute_dtype`` as the loop reaches it, and its gradient is summed over the devices and
    scattered back to their rows as the backward loop leaves it, in ``lm_head``'s own dtype. No
    device holds the whole head or its whole gradient (at Qwen3-8B's 4,096 x 151,936 in float32,
    2.3 GiB each), and no device's partial gradient is rounded to bfloat16: pass the parameter
    (float32) and ``compute_dtype`` (e.g. bfloat16, what the matmuls take). Per-token values do
    not depend on the split; ``chunk_size`` counts a device's tokens. Without a mesh that splits
    the tokens it is :func:`token_logprobs_and_entropy`.
    """
    _check_inputs(hidden, lm_head, targets, bias, chunk_size, vocab_chunk_size)
    mesh = jax.sharding.get_abstract_mesh()
    spec = None if mesh.empty else logical_to_spec(("batch", "length"), targets.shape, mesh)
    token_axes = () if spec is None else tuple(
        axis for entry in spec for axis in spec_axes(entry) if mesh.shape[axis] > 1)
    if not token_axes:
        return _token_head(hidden, lm_head, targets, bias, chunk_size, vocab_chunk_size, compute_dtype, ())
    gather_axes = token_axes if lm_head.shape[0] % math.prod(mesh.shape[a] for a in token_axes) == 0 else ()
    head = functools.partial(_token_head, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
                             compute_dtype=compute_dtype, gather_axes=gather_axes)
    return jax.shard_map(head,
                         in_specs=(PartitionSpec(*spec, None), PartitionSpec(gather_axes or None, None), spec,
                                   PartitionSpec()),
                         out_specs=(spec, spec), check_vma=False)(hidden, lm_head, targets, bias)
