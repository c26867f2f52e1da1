"""Conversations' KV caches kept between model turns by the embedded sampler.

Without it, every model turn of a multi-turn rollout re-reads the whole conversation: turn t
prefills the prompt, every earlier turn and every tool response again, so the prefill grows
with the conversation and dominates a rollout's time (docs/agentic.md#throughput). With it,
``JaxSampler.continue_conversations`` keeps the cache of its last call on the devices; when
every conversation of the next call continues one of its rows (the conversation's tokens up to
its last model turn are that row's tokens), the call gathers those rows and feeds only what
was appended since (the environment's observation), then decodes as usual.

Layout: a call's rows share one write index (the sampler's left-padded layout), so the new
tokens are written left-padded into the next ``C`` cache rows (``C`` the longest chunk's
bucket) and decoding continues after them. A row whose chunk or turn was shorter than the
longest leaves empty cache rows between its tokens (segment id 0: never attended to), and each
token keeps its position in its conversation, so attention and RoPE see exactly the
conversation: the logprobs are a fresh prefill's up to float32 rounding
(tests/env/test_turn_cache.py).

MoE models: the routes of positions already in the cache are not computed again; the sample
of a continued turn reports the routes of what this call fed (the previous turn's last token,
kept from its decode step, and the new tokens) and -1 before them, which is all
``Conversation.add_model_turn`` reads: earlier positions keep the routes they had.

A call falls back to reading the conversations afresh (and keeps that cache instead) when a
model has a linear-attention layer (its recurrent state would decay across the empty rows),
with several JAX processes, more conversations than ``max_batch``, after a weight push, for a
conversation without a model turn or without new tokens, or when the kept cache would outgrow
``max_cache_len``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rollout.base import Conversation
from jaxrl.rollout.decode import decode_loop, forget_unwritten, gather_rows


def keeps_turns(config) -> bool:
    """Whether a model can continue conversations from a kept cache: softmax attention in every
    layer, one JAX process (see the module doc)."""
    return all(kind == "full_attention" for kind in config.layer_types) and jax.process_count() == 1


@dataclasses.dataclass(frozen=True)
class Continuation:
    """How a call continues the kept cache: ``take`` [n] the kept row of each conversation,
    ``chunks`` the tokens appended since, ``base`` [n] the tokens already in the cache."""

    take: np.ndarray
    chunks: list[np.ndarray]
    base: np.ndarray


@dataclasses.dataclass
class TurnCache:
    """The cache of the sampler's last ``continue_conversations`` call and, for MoE models, the
    routes of each row's last token (device arrays); which row holds which conversation (its
    token ids, as bytes), each row's token count, the next cache row to write, and the weight
    version it was computed with."""

    cache: object
    last_routes: object
    rows: dict[bytes, int]
    lengths: np.ndarray
    index: int
    version: str

    @classmethod
    def after(cls, kept: tuple, prompts: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
              version: str) -> "TurnCache":
        """What a call over ``prompts`` that generated ``outputs`` (row r: prompt r) keeps:
        ``kept`` = (cache, last routes or None, ...) from the jitted call."""
        cache, last_routes = kept[:2]
        tokens = [np.concatenate([p, o]).astype(np.int32) for p, o in zip(prompts, outputs, strict=True)]
        return cls(cache, last_routes, {t.tobytes(): r for r, t in enumerate(tokens)},
                   np.array([t.size for t in tokens]), int(jax.device_get(cache.index)), version)

    def plan(self, conversations: Sequence[Conversation], version: str) -> Continuation | None:
        """The continuation of ``conversations`` from this cache, or None when one of them does
        not continue a kept row (or the weights changed)."""
        if version != self.version:
            return None
        take, chunks = [], []
        for conversation in conversations:
            model_tokens = np.flatnonzero(conversation.model_mask)
            if model_tokens.size == 0:
                return None
            end = int(model_tokens[-1]) + 1
            row = self.rows.get(np.asarray(conversation.token_ids[:end], np.int32).tobytes())
            if row is None or end == len(conversation.token_ids):
                return None
            take.append(row)
            chunks.append(np.asarray(conversation.token_ids[end:], np.int32))
        take = np.asarray(take, np.int32)
        return Continuation(take, chunks, self.lengths[take].astype(np.int32))


def _continue(graphdef, state, cache, last_routes, take, chunk_ids, chunk_lengths, base, keys, temperature, top_k,
              top_p, stop_ids, max_new_tokens, *, new_token_bucket: int, cache_len: int):
    """Gathers the kept rows ``take`` [B] of ``cache`` (grown to ``cache_len`` rows), writes
    each row's chunk chunk_ids [B, C] (left-padded, chunk_lengths [B] tokens, positions from
    base [B]) at the shared index, then decodes. Rows with an empty chunk are padding.
    Returns ((tokens, raw, processed logprobs [B, N], lengths, stopped, routes [B, N, L_moe, k],
    the chunk's routes [B, C, L_moe, k], the kept last routes of the rows taken [B, L_moe, k];
    the routes None for dense models), (the kept cache, its rows' last routes))."""
    from flax import nnx

    model = nnx.merge(graphdef, state)
    cache = gather_rows(cache, take, cache_len, model.config.layer_types)
    width = chunk_ids.shape[1]
    pad = (width - chunk_lengths)[:, None]
    slots = jnp.arange(width, dtype=jnp.int32)[None, :]
    out = model(chunk_ids, base[:, None] + jnp.maximum(slots - pad, 0), (slots >= pad).astype(jnp.int32),
                cache=cache)
    logits = model.head(out.hidden[:, -1:])[:, 0]
    decode_start = cache.index + width
    chunk_routes = out.routed_experts
    d = decode_loop(model, logits, out.cache, base + chunk_lengths, chunk_lengths == 0, keys, temperature, top_k,
                    top_p, stop_ids, max_new_tokens, None if chunk_routes is None else chunk_routes[:, -1],
                    new_token_bucket=new_token_bucket)
    previous = None if last_routes is None else jnp.take(last_routes, take, axis=0)
    return ((d.tokens, d.raw, d.processed, d.lengths, d.stopped, d.routes, chunk_routes, previous),
            (forget_unwritten(d.cache, decode_start, d.lengths), d.last_routes))


def continued_prompt_routes(length: int, chunk: int, width: int, previous: np.ndarray,
                            chunk_routes: np.ndarray) -> np.ndarray:
    """A continued turn's ``Sample.prompt_routed_experts`` [length - 1, L_moe, k]: -1 for the
    positions already in the cache, then the previous turn's last token (``previous``) and the
    chunk's tokens but its last (``chunk_routes`` [width, ...], left-padded, of ``chunk`` tokens)."""
    out = np.full((length - 1,) + previous.shape, -1, np.int32)
    out[length - chunk - 1] = previous
    out[length - chunk:] = chunk_routes[width - chunk:width - 1]
    return out


continue_jit = jax.jit(_continue, static_argnums=(0,), static_argnames=("new_token_bucket", "cache_len"))

__all__ = ["Continuation", "TurnCache", "continue_jit", "continued_prompt_routes", "keeps_turns"]
