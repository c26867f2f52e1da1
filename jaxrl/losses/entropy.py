"""Token logprobs and entropy, entropy bonus, Clip-Cov / KL-Cov, entropy law (SPEC section 4).

Shapes: ``B`` sequences of ``T`` positions, hidden size ``D``, vocabulary ``V``.
Every statistic is computed in float32 whatever the input dtype.

The LM head is the largest activation in RL post-training: ``[B, T, V]``
float32 logits for ``T = 8192`` and ``V = 151,936`` are 5 GB per sequence, and
autodiff keeps several of them alive. :func:`token_logprobs_and_entropy`
computes the two per-token statistics the losses need straight from the hidden
states and the LM-head weight, one ``[chunk_size, vocab_chunk_size]`` tile at a
time, and recomputes each tile in the backward pass (the Liger idea used by
Motif), so no ``[B, T, V]`` array is ever held.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools

import jax
import jax.numpy as jnp

from jaxrl.losses._validate import (
    check_floating,
    check_integer,
    check_interval,
    check_mask,
    check_ordered,
    check_positive,
    check_rank,
    check_same_shape,
)

__all__ = [
    "token_logprobs_from_logits",
    "token_entropy_from_logits",
    "token_logprobs_and_entropy",
    "entropy_bonus",
    "centered_cov",
    "clip_cov_mask",
    "kl_cov_select",
    "kl_cov_gap_penalty",
    "kl_cov_penalty",
    "EntropyLawFit",
    "fit_entropy_law",
]


# --------------------------------------------------------------------------- #
# From logits
# --------------------------------------------------------------------------- #
def token_logprobs_from_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Log-probability of each target token, in float32.

    ``logp[...] = logits[..., y] - logsumexp(logits[...])`` (SPEC section 4).

    Args:
      logits: ``[..., V]`` any float dtype.
      targets: ``[...]`` integer token ids.
    Returns:
      ``[...]`` float32.
    """
    check_floating("logits", logits)
    check_integer("targets", targets)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets has shape {targets.shape} but logits has shape {logits.shape}; "
            f"expected targets.shape == logits.shape[:-1]"
        )
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def token_entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of the next-token distribution, in float32.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` (SPEC section 4).

    Args:
      logits: ``[..., V]`` any float dtype.
    Returns:
      ``[...]`` float32.
    """
    check_floating("logits", logits)
    z = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(z, axis=-1)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


# --------------------------------------------------------------------------- #
# From hidden states and the LM-head weight, in tiles
# --------------------------------------------------------------------------- #
def _vocab_tile(lm_head, bias, tile_index, vocab_chunk):
    """Columns of tile ``tile_index``: (first column, weight [D, vc], bias [vc] f32 or None, col ids, valid).

    The last tile is clamped to end at ``V`` instead of padding the weight (a
    padded copy of a 150k-column head would cost as much as the head); its
    columns that the previous tile already covered are marked invalid.
    """
    vocab = lm_head.shape[1]
    start = jnp.minimum(tile_index * vocab_chunk, vocab - vocab_chunk)
    weight = jax.lax.dynamic_slice_in_dim(lm_head, start, vocab_chunk, axis=1)
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


def _head_forward(hidden, lm_head, bias, targets, vocab_chunk):
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
        _, weight, tile_bias, cols, valid = _vocab_tile(lm_head, bias, j, vocab_chunk)

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_head(hidden, lm_head, bias, targets, vocab_chunk):
    logp, entropy, _ = _head_forward(hidden, lm_head, bias, targets, vocab_chunk)
    return logp, entropy


def _chunked_head_fwd(hidden, lm_head, bias, targets, vocab_chunk):
    logp, entropy, lse = _head_forward(hidden, lm_head, bias, targets, vocab_chunk)
    return (logp, entropy), (hidden, lm_head, bias, targets, lse, entropy)


def _chunked_head_bwd(vocab_chunk, residuals, cotangents):
    """Recomputes each tile's logits; d logp/dz = onehot - p, dH/dz = -p (log p + H).

    Vocab tiles outside, token chunks inside: the weight gradient of a tile is
    accumulated in float32 over all tokens and written once in the weight's
    dtype; the hidden gradient [N, D] is accumulated in float32.
    """
    hidden, lm_head, bias, targets, lse, entropy = residuals
    g_logp, g_entropy = cotangents
    num_chunks = targets.shape[0]
    num_tiles = -(-lm_head.shape[1] // vocab_chunk)
    f32 = jnp.float32

    def vocab_step(j, carry):
        d_hidden, d_head, d_bias = carry
        start, weight, tile_bias, cols, valid = _vocab_tile(lm_head, bias, j, vocab_chunk)
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


def token_logprobs_and_entropy(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = 1024,
    vocab_chunk_size: int | None = 32768,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Target-token logprobs and token entropy from hidden states, tile by tile.

    ``z = hidden @ lm_head (+ bias)``; ``logp = z_y - logsumexp(z)``,
    ``H = -sum softmax(z) log softmax(z)`` (SPEC section 4), never materialising
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
    Returns:
      ``(logp, entropy)``, each ``[B, T]`` float32. Differentiable w.r.t.
      ``hidden``, ``lm_head`` and ``bias`` (reverse mode; gradients come back in
      the inputs' dtypes).
    """
    check_rank("hidden", hidden, 3)
    check_rank("lm_head", lm_head, 2)
    check_floating("hidden", hidden)
    check_floating("lm_head", lm_head)
    check_integer("targets", targets)
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
        check_floating("bias", bias)
        if bias.shape != (vocab,):
            raise ValueError(f"bias has shape {bias.shape} but shape {(vocab,)} was expected")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r} but a positive integer was expected")
    if vocab_chunk_size is not None and (not isinstance(vocab_chunk_size, int) or vocab_chunk_size <= 0):
        raise ValueError(
            f"vocab_chunk_size={vocab_chunk_size!r} but a positive integer or None was expected")

    num_tokens = batch * length
    chunk = min(chunk_size, num_tokens)
    vocab_chunk = vocab if vocab_chunk_size is None else min(vocab_chunk_size, vocab)
    pad = -num_tokens % chunk
    h = jnp.pad(hidden.reshape(num_tokens, dim), ((0, pad), (0, 0)))
    y = jnp.pad(targets.reshape(num_tokens).astype(jnp.int32), (0, pad))
    logp, entropy = _chunked_head(h.reshape(-1, chunk, dim), lm_head, bias,
                                  y.reshape(-1, chunk), vocab_chunk)
    unpad = lambda x: x.reshape(-1)[:num_tokens].reshape(batch, length)
    return unpad(logp), unpad(entropy)


# --------------------------------------------------------------------------- #
# Entropy bonus and covariance-based entropy control
# --------------------------------------------------------------------------- #
def _check_token_inputs(mask, **arrays):
    for name, x in arrays.items():
        check_floating(name, x)
    check_mask("mask", mask)
    check_rank("mask", mask, 2)
    check_same_shape(mask=mask, **arrays)


def entropy_bonus(entropy: jax.Array, mask: jax.Array, *, coef: float) -> jax.Array:
    """Per-token entropy-bonus loss term ``-coef * H_t`` on masked tokens (SPEC section 4).

    Returned per token so the objective aggregates it with the same mode and
    normaliser as the policy loss (independent of the micro-batch split).

    Args:
      entropy: ``[B, T]`` float token entropy (carries gradient).
      mask: ``[B, T]`` bool/0-1, 1 on policy-generated tokens.
      coef: entropy coefficient (>= 0; adding the term to a minimised loss raises entropy).
    Returns:
      ``[B, T]`` float32, zero where ``mask`` is 0.
    """
    _check_token_inputs(mask, entropy=entropy)
    check_positive("coef", coef, allow_zero=True)
    return jnp.where(mask.astype(bool), -coef * entropy.astype(jnp.float32), 0.0)


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def centered_cov(logp: jax.Array, advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token centred cross-product ``Cov_i = (logp_i - mean logp)(A_i - mean A)`` (SPEC section 4).

    Means run over the ``N`` masked tokens of the whole batch; ``logp`` is
    detached (the statistic selects tokens, it is not a loss).

    Args:
      logp: ``[B, T]`` float current logprobs.
      advantages: ``[B, T]`` float token advantages.
      mask: ``[B, T]`` bool/0-1.
    Returns:
      ``[B, T]`` float32, zero where ``mask`` is 0.
    """
    _check_token_inputs(mask, logp=logp, advantages=advantages)
    keep = mask.astype(bool)
    logp = jax.lax.stop_gradient(logp).astype(jnp.float32)
    advantages = jax.lax.stop_gradient(advantages).astype(jnp.float32)
    cov = (logp - _masked_mean(logp, keep)) * (advantages - _masked_mean(advantages, keep))
    return jnp.where(keep, cov, 0.0)


def _floor_fraction_of(count: jax.Array, ratio: float) -> jax.Array:
    """``floor(ratio * count)`` exactly, reading ``ratio`` as the decimal it was written as.

    ``2e-4 * 5000`` must give 1, which float32 does not guarantee. With
    ``ratio = p / q`` in lowest terms, ``floor(n p / q) = (n // q) p + ((n % q) p) // q``
    stays inside int32 while ``p q < 2**31`` (any ratio with a few decimals);
    beyond that it falls back to float32.
    """
    frac = fractions.Fraction(repr(float(ratio)))
    p, q = frac.numerator, frac.denominator
    count = count.astype(jnp.int32)
    if p * q < 2**31:
        return (count // q) * p + ((count % q) * p) // q
    return jnp.floor(count.astype(jnp.float32) * ratio).astype(jnp.int32)


def _rank(score: jax.Array) -> jax.Array:
    """Rank of each element of a 1-D array in ascending order (ties by position)."""
    order = jnp.argsort(score, stable=True)
    return jnp.zeros_like(order).at[order].set(jnp.arange(score.shape[0], dtype=order.dtype))


def clip_cov_mask(
    logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    key: jax.Array,
    *,
    ratio: float = 2e-4,
    omega_low: float = 1.0,
    omega_high: float = 5.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clip-Cov: tokens whose policy gradient is detached (SPEC section 4).

    Among masked tokens with ``omega_low <= Cov_i <= omega_high`` pick
    ``floor(ratio * N)`` uniformly at random with ``key`` (all of them if fewer
    qualify). The objective zeroes those tokens' policy-gradient term. (verl
    takes ``max(floor(ratio * N), 1)``; SPEC says ``floor``.) Compute it once
    on the whole optimizer-step batch and hand the mask to every micro-batch,
    so the choice does not depend on the micro-batch split.

    Args:
      logp: ``[B, T]`` float current logprobs.
      advantages: ``[B, T]`` float token advantages.
      mask: ``[B, T]`` bool/0-1.
      key: a ``jax.random`` key; the same key gives the same selection.
      ratio: fraction of the ``N`` masked tokens to detach, in [0, 1].
      omega_low, omega_high: the covariance band.
    Returns:
      ``(detach [B, T] bool, metrics)``; metrics (scalars): ``clip_cov_count``
      (int32, tokens detached), ``clip_cov_candidates`` (int32, tokens in the
      band), ``clip_cov_fraction`` (float32, count / N).
    """
    cov = centered_cov(logp, advantages, mask)
    check_interval("ratio", ratio, 0.0, 1.0)
    check_ordered("omega_low", omega_low, "omega_high", omega_high)
    keep = mask.astype(bool)
    num_tokens = jnp.sum(keep, dtype=jnp.int32)
    candidate = keep & (cov >= omega_low) & (cov <= omega_high)
    # Uniform draws sort the candidates in a random order; the others go last.
    draw = jax.random.uniform(key, cov.shape)
    rank = _rank(jnp.where(candidate, draw, 2.0).reshape(-1)).reshape(cov.shape)
    detach = candidate & (rank < _floor_fraction_of(num_tokens, ratio))
    count = jnp.sum(detach, dtype=jnp.int32)
    return detach, {
        "clip_cov_count": count,
        "clip_cov_candidates": jnp.sum(candidate, dtype=jnp.int32),
        "clip_cov_fraction": count / jnp.maximum(num_tokens, 1).astype(jnp.float32),
    }


def kl_cov_select(
    logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ratio: float = 2e-3,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL-Cov's tokens: the top ``floor(ratio * N)`` masked tokens by ``Cov_i`` (SPEC section 4).

    Selection is deterministic: largest ``Cov_i`` first, ties by position in the
    flattened ``[B, T]`` batch. Select once on the whole optimizer-step batch
    and hand the result to :func:`kl_cov_gap_penalty` per micro-batch, so the
    choice does not depend on the micro-batch split.

    Args:
      logp: ``[B, T]`` float current logprobs (detached here).
      advantages: ``[B, T]`` float token advantages.
      mask: ``[B, T]`` bool/0-1.
      ratio: fraction of the ``N`` masked tokens to select, in [0, 1].
    Returns:
      ``(selected [B, T] bool, metrics)``; metrics: ``kl_cov_count`` (int32),
      ``kl_cov_fraction`` (float32, count / N).
    """
    cov = centered_cov(logp, advantages, mask)
    check_interval("ratio", ratio, 0.0, 1.0)
    keep = mask.astype(bool)
    num_tokens = jnp.sum(keep, dtype=jnp.int32)
    rank = _rank(jnp.where(keep, -cov, jnp.inf).reshape(-1)).reshape(cov.shape)
    selected = keep & (rank < _floor_fraction_of(num_tokens, ratio))
    count = jnp.sum(selected, dtype=jnp.int32)
    return selected, {
        "kl_cov_count": count,
        "kl_cov_fraction": count / jnp.maximum(num_tokens, 1).astype(jnp.float32),
    }


def kl_cov_gap_penalty(
    logp: jax.Array,
    old_logp: jax.Array,
    selected: jax.Array,
    *,
    beta: float = 1.0,
) -> jax.Array:
    """KL-Cov's per-token term ``beta * |logp - old_logp|`` on the ``selected`` tokens (SPEC section 4).

    The penalty carries gradient through ``logp`` and is added to those tokens'
    per-token loss before aggregation. (verl also drops the PPO clip on the
    selected tokens; SPEC only adds the term, so that choice is left to the
    objective.)

    Args:
      logp: ``[B, T]`` float current logprobs (carries gradient).
      old_logp: ``[B, T]`` float logprobs at sampling time (detached here).
      selected: ``[B, T]`` bool/0-1, e.g. from :func:`kl_cov_select` (0 on unmasked tokens).
      beta: penalty coefficient (>= 0).
    Returns:
      ``[B, T]`` float32, zero off ``selected``.
    """
    check_floating("logp", logp)
    check_floating("old_logp", old_logp)
    check_mask("selected", selected)
    check_same_shape(logp=logp, old_logp=old_logp, selected=selected)
    check_positive("beta", beta, allow_zero=True)
    gap = jnp.abs(logp.astype(jnp.float32) - jax.lax.stop_gradient(old_logp).astype(jnp.float32))
    return jnp.where(selected.astype(bool), beta * gap, 0.0)


def kl_cov_penalty(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ratio: float = 2e-3,
    beta: float = 1.0,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """KL-Cov: ``beta * |logp - old_logp|`` on the top ``floor(ratio * N)`` tokens by ``Cov_i`` (SPEC section 4).

    :func:`kl_cov_select` then :func:`kl_cov_gap_penalty` on the same tokens.

    Args:
      logp: ``[B, T]`` float current logprobs (carries gradient).
      old_logp: ``[B, T]`` float logprobs at sampling time (detached here).
      advantages: ``[B, T]`` float token advantages.
      mask: ``[B, T]`` bool/0-1.
      ratio: fraction of the ``N`` masked tokens to penalise, in [0, 1].
      beta: penalty coefficient (>= 0).
    Returns:
      ``(penalty [B, T] float32, selected [B, T] bool, metrics)``; metrics:
      ``kl_cov_count`` (int32), ``kl_cov_fraction`` (float32, count / N).
    """
    selected, metrics = kl_cov_select(logp, advantages, mask, ratio=ratio)
    return kl_cov_gap_penalty(logp, old_logp, selected, beta=beta), selected, metrics


# --------------------------------------------------------------------------- #
# Entropy-performance law
# --------------------------------------------------------------------------- #
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EntropyLawFit:
    """Least-squares fit of ``R = -a exp(H) + b`` (SPEC section 4); all float32 scalars.

    ``ceiling = b - a`` is the reward predicted when entropy reaches 0.
    """

    a: jax.Array
    b: jax.Array
    ceiling: jax.Array
    rmse: jax.Array


def fit_entropy_law(entropy: jax.Array, reward: jax.Array) -> EntropyLawFit:
    """Fits ``R = -a exp(H) + b`` by least squares over training steps (SPEC section 4).

    Ordinary least squares of ``R`` on ``x = exp(H)``: ``a = -cov(x, R) / var(x)``,
    ``b = mean(R) + a mean(x)``, computed on centred values in float32.

    Args:
      entropy: ``[S]`` float mean policy entropy per step (fit on early steps).
      reward: ``[S]`` float mean reward per step.
    Returns:
      :class:`EntropyLawFit` with ``a``, ``b``, ``ceiling = b - a`` and the RMSE
      of the fitted rewards. Needs ``S >= 2`` and entropies that are not all equal
      (otherwise ``a`` is not identified and comes back NaN).
    """
    check_rank("entropy", entropy, 1)
    check_floating("entropy", entropy)
    check_floating("reward", reward)
    check_same_shape(entropy=entropy, reward=reward)
    if entropy.shape[0] < 2:
        raise ValueError(
            f"entropy has {entropy.shape[0]} step(s) but at least 2 are needed to fit a and b")
    x = jnp.exp(entropy.astype(jnp.float32))
    r = reward.astype(jnp.float32)
    x_c, r_c = x - jnp.mean(x), r - jnp.mean(r)
    a = -jnp.sum(x_c * r_c) / jnp.sum(x_c * x_c)
    b = jnp.mean(r) + a * jnp.mean(x)
    rmse = jnp.sqrt(jnp.mean((r - (b - a * x)) ** 2))
    return EntropyLawFit(a=a, b=b, ceiling=b - a, rmse=rmse)
