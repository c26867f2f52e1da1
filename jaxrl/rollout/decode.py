"""One decode step's sampling and the decode loop, shared by the embedded sampler's fresh
generation (``jaxrl.rollout.sampler``) and its continuation of conversations from a kept KV
cache (``jaxrl.rollout.turn_cache``). Sampling semantics: the module doc of
``jaxrl.rollout.sampler``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.rollout import noise

F32 = jnp.float32


def processed_logits(logits: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """The logits of the distribution sampled from, -inf outside the top-k/top-p support.

    logits: [B, V] float32; temperature (> 0), top_k (0 = off), top_p ((0, 1], 1 = off): scalars
    (traced or Python). Returns [B, V] float32 ``logits / temperature`` with filtered tokens at -inf.

    The support is the first ``n`` tokens in the order (value descending, lower id first on
    ties), ``n`` the number of sorted positions inside both top-k and top-p. Only the values
    are sorted (an int32 sort of order-preserving keys, about 6x faster than a float sort on
    XLA:CPU); the support is then ``value > v_n`` plus the lowest-id ties of ``v_n``, so no
    permutation is built or scattered back.
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(F32) / temperature
    sorted_desc = _sorted_descending(scaled)
    rank = jnp.arange(vocab)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    in_top_k = rank < k
    sorted_probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    in_top_p = (mass_before < top_p) | (top_p >= 1.0)
    kept = jnp.maximum(jnp.sum(in_top_k & in_top_p, axis=-1, keepdims=True), 1)  # [B, 1]
    threshold = jnp.take_along_axis(sorted_desc, kept - 1, axis=-1)
    above, tied = scaled > threshold, scaled == threshold
    room = kept - jnp.sum(above, axis=-1, keepdims=True)
    keep = above | (tied & (jnp.cumsum(tied, axis=-1) <= room))
    return jnp.where(keep, scaled, -jnp.inf)


def _sorted_descending(x: jax.Array) -> jax.Array:
    """x [B, V] float32 sorted descending along the last axis, via int32 keys whose order is the
    float order (negative floats get their magnitude bits flipped)."""
    flip = jnp.int32(0x7FFFFFFF)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    keys = jnp.sort(jnp.where(bits < 0, bits ^ flip, bits), axis=-1)[:, ::-1]
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ flip, keys), F32)


def first_argmax(x: jax.Array) -> jax.Array:
    """``argmax`` over the last axis, the lowest index on ties, via a max and a min reduction."""
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1]), x.shape[-1]), axis=-1)


def sample_step(logits: jax.Array, keys: jax.Array, temperature, top_k, top_p):
    """Draws one token per row. logits [B, V] float32, keys [B, 2] uint32 raw PRNG keys.

    Returns (tokens [B] int32, raw logprob [B] float32, processed logprob [B] float32).
    """
    logits = logits.astype(F32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    greedy = temperature <= 0
    safe_temperature = jnp.where(greedy, 1.0, temperature)
    # The sort behind top-k/top-p costs O(V log V) per row and step: skipped when both are off.
    filtered = jax.lax.cond((top_k > 0) | (top_p < 1.0),
                            lambda: processed_logits(logits, safe_temperature, top_k, top_p),
                            lambda: logits / safe_temperature)
    # Gumbel-max as jax.random.categorical draws (the same noise, so the same tokens), with the
    # noise hashed in one fusion (jaxrl.rollout.noise) and the argmax as two plain reductions:
    # on XLA:CPU jax's rolled hash loop and the (value, index) argmax reduction each cost about
    # as much as a small model's forward in a decode step.
    drawn = first_argmax(filtered + noise.gumbel(keys, logits.shape[-1]))
    tokens = jnp.where(greedy, first_argmax(logits), drawn).astype(jnp.int32)
    processed = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), tokens[:, None], axis=-1)[:, 0]
    raw_token = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return tokens, raw_token, jnp.where(greedy, 0.0, processed)


@jax.jit
def row_keys(seed, job):
    """PRNG key of sample job[r, 1] of prompt job[r, 0]: independent of batching."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(base, i), j))(job[:, 0], job[:, 1])


class Decoded(NamedTuple):
    """What :func:`decode_loop` returns: tokens, raw and processed logprobs [B, N] (0 past each
    row's length), lengths [B], stopped [B], routes [B, N, L_moe, k] (row j: the route of the
    position that produced token j), last_routes [B, L_moe, k] (the route of each row's last fed
    token, which no output row holds; routes of the position before it when a row made none),
    both None for dense models, the cache after the loop and the next-token logits [B, V] after
    each row's last fed token (what a later round of the same generation samples from first)."""

    tokens: jax.Array
    raw: jax.Array
    processed: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    routes: jax.Array | None
    last_routes: jax.Array | None
    cache: object
    logits: jax.Array


def decode_loop(model, logits, cache, start_positions, done, keys, temperature, top_k, top_p, stop_ids,
                max_new_tokens, first_routes, *, new_token_bucket: int, feed_last: bool = True,
                first_step=0) -> Decoded:
    """Samples up to ``max_new_tokens`` tokens per row from ``logits`` [B, V] (the next-token
    logits after each row's context), feeding each sampled token to ``model`` through ``cache``
    (every row writes the cache's shared index). start_positions [B]: the position of each row's
    first new token; done [B]: rows that take no part (padding); keys [B, 2]: each row's PRNG
    key (step ``s`` draws with ``fold_in(key, s)``); first_routes: [B, L_moe, k] int32, the
    routes of the position that produced ``logits`` (None for dense models).

    Every sampled token is fed, the last one too, so afterwards the cache holds each row's
    context and its ``lengths`` new tokens; a row that stopped early wrote on (unused tokens)
    until the loop ended: :func:`forget_unwritten` masks those cache rows. With ``feed_last``
    False the token of step ``max_new_tokens - 1`` is sampled but not fed (a caller that drops the
    cache never reads it: one model call fewer); the cache then lacks it and ``last_routes`` is
    None. N = new_token_bucket.

    ``first_step`` (traced scalar; 0 for a whole generation) makes the call one round of a longer
    generation (``jaxrl.rollout.rounds``): it runs steps ``first_step .. first_step + N - 1`` (each
    still drawing with ``fold_in(key, step)`` at position ``start_positions + step``), output
    column ``j`` holding step ``first_step + j`` and ``lengths`` counting this round's tokens.
    """
    batch = logits.shape[0]
    tokens = jnp.zeros((batch, new_token_bucket), jnp.int32)
    raw = jnp.zeros((batch, new_token_bucket), F32)
    processed = jnp.zeros((batch, new_token_bucket), F32)
    lengths = jnp.zeros((batch,), jnp.int32)
    routes = None
    if first_routes is not None:  # one row more than the outputs: the last fed token's route
        routes = jnp.zeros((batch, new_token_bucket + 1) + first_routes.shape[1:], jnp.int32)
        routes = routes.at[:, 0].set(first_routes)

    def sample(step, logits, done, lengths, tokens, raw, processed):
        token, raw_lp, proc_lp = sample_step(logits, noise.fold_in(keys, step), temperature, top_k, top_p)
        live = ~done & (step < max_new_tokens)
        column = step - first_step
        tokens = tokens.at[:, column].set(jnp.where(live, token, 0))
        raw = raw.at[:, column].set(jnp.where(live, raw_lp, 0.0))
        processed = processed.at[:, column].set(jnp.where(live, proc_lp, 0.0))
        done = done | (live & jnp.isin(token, stop_ids))
        return token, done, lengths + live.astype(jnp.int32), tokens, raw, processed

    fed_steps = jnp.minimum(max_new_tokens if feed_last else max_new_tokens - 1, first_step + new_token_bucket)

    def keep_going(carry):
        step, _, _, done, *_ = carry
        return (step < fed_steps) & ~jnp.all(done)

    def body(carry):
        step, logits, cache, done, lengths, tokens, raw, processed, routes = carry
        token, done, lengths, tokens, raw, processed = sample(step, logits, done, lengths, tokens, raw, processed)
        position = (start_positions + step)[:, None]
        out = model(token[:, None], position, jnp.ones_like(position), cache=cache)
        if routes is not None:
            routes = routes.at[:, step - first_step + 1].set(out.routed_experts[:, 0])
        logits = model.head(out.hidden)[:, 0]
        return step + 1, logits, out.cache, done, lengths, tokens, raw, processed, routes

    carry = (jnp.asarray(first_step, jnp.int32), logits, cache, done, lengths, tokens, raw, processed, routes)
    step, logits, cache, done, lengths, tokens, raw, processed, routes = jax.lax.while_loop(keep_going, body, carry)
    last = None
    if not feed_last:  # the unfed last step (a no-op when every row is done or nothing was asked for)
        step = jnp.minimum(step, first_step + new_token_bucket - 1)
        _, done, lengths, tokens, raw, processed = sample(step, logits, done, lengths, tokens, raw, processed)
    elif routes is not None:
        last = jnp.take_along_axis(routes, lengths[:, None, None, None], axis=1)[:, 0]
    if routes is not None:
        routes = routes[:, :new_token_bucket]
    return Decoded(tokens, raw, processed, lengths, done, routes, last, cache, logits)


def forget_unwritten(cache, decode_start, lengths):
    """``cache`` with the rows each batch row wrote after its last real token (slots from
    ``decode_start + lengths``) marked empty (segment id 0), so a later call attends only to
    each conversation's own tokens."""
    slots = jnp.arange(cache.segment_ids.shape[1], dtype=jnp.int32)[None, :]
    unwritten = slots >= (decode_start + lengths)[:, None]
    return cache._replace(segment_ids=jnp.where(unwritten, 0, cache.segment_ids))


def take_and_grow(x, take, cache_len: int | None = None):
    """x [B, S, ...] -> the rows ``take`` [B'] of ``x``, with empty rows (zeros) appended up to
    ``cache_len`` along axis 1 (None: rows only)."""
    x = jnp.take(x, take, axis=0)
    if cache_len is None:
        return x
    return jnp.pad(x, [(0, 0), (0, cache_len - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def gather_rows(cache, take, cache_len: int, layer_types, per_array=take_and_grow):
    """``cache`` with the batch rows ``take`` [B'] (in that order) and ``cache_len`` cache rows: the
    segment ids and the softmax layers' keys and values (``layer_types[i] == "full_attention"``)
    keep their rows and gain empty ones at the end (segment id 0: never attended); other layers'
    fixed-size recurrent states are only gathered. The shared write index is kept.
    ``per_array(x, take, cache_len or None)`` computes each array, one at a time (default
    :func:`take_and_grow`, traced into the caller's program)."""
    def grown(x):
        return per_array(x, take, cache_len)

    def rows(x):
        return per_array(x, take, None)

    layers = tuple(jax.tree.map(grown if kind == "full_attention" else rows, layer)
                   for kind, layer in zip(layer_types, cache.layers, strict=True))
    return cache._replace(layers=layers, segment_ids=grown(cache.segment_ids))


__all__ = ["Decoded", "decode_loop", "first_argmax", "forget_unwritten", "gather_rows", "processed_logits",
           "row_keys", "sample_step", "take_and_grow"]
