"""Checkpoints for SGLang tests and benchmarks (no model hub here): random ``jaxrl.models.Decoder``s,
and constructed ones whose greedy output is known (``write_bigram_checkpoint``)."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx

from jaxrl.models import Decoder, ModelConfig, save_hf_checkpoint


def random_decoder(config: ModelConfig, seed: int = 0, matrix_scale: float = 10.0) -> Decoder:
    """A ``Decoder`` with random weights; matrices scaled by ``matrix_scale``.

    The default init is so small that every next-token distribution is nearly
    uniform, where raw, temperature-scaled and filtered logprobs can hardly be
    told apart; scaled-up matrices give peaked, varied distributions.
    """
    model = Decoder(config, rngs=nnx.Rngs(seed))
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda x: x * matrix_scale if x.ndim > 1 else x, state))
    return model


def write_random_checkpoint(path: str, config: ModelConfig, seed: int = 0, matrix_scale: float = 10.0) -> Decoder:
    """Writes ``random_decoder(config, seed, matrix_scale)`` as an HF checkpoint to ``path``; returns it."""
    model = random_decoder(config, seed, matrix_scale)
    save_hf_checkpoint(model, path)
    return model



def write_bigram_checkpoint(path: str, config: ModelConfig, next_token: Sequence[int | Sequence[int]],
                            seed: int = 0) -> Decoder:
    """Writes (and returns) a decoder of ``config`` whose greedy decoding is a bigram program: after
    token ``a`` comes ``next_token[a]`` (one entry per vocabulary id), whatever precedes it. An
    entry may be a tuple of successors instead, which share the top logit: sampled at temperature
    1, the next token is one of them, each equally likely.

    How: every attention ``o_proj`` and MLP ``down_proj`` is zero, so each position's residual
    stream is its token's embedding. Token ``a``'s embedding is the sum of the unit vectors of the
    slots of its successors (one slot per distinct successor, at most ``hidden_size``), and the LM
    head column of each successor is 10 times its slot's unit vector. After the final RMSNorm
    each of ``a``'s ``m`` successors has the logit ``10 * sqrt(hidden_size / m)`` and every other
    token 0.
    """
    if len(next_token) != config.vocab_size:
        raise ValueError(f"next_token has {len(next_token)} entries for a vocabulary of {config.vocab_size}")
    successors = [(entry,) if isinstance(entry, (int, np.integer)) else tuple(entry) for entry in next_token]
    slots = {token: i for i, token in enumerate(sorted({t for entry in successors for t in entry}))}
    if len(slots) > config.hidden_size:
        raise ValueError(f"{len(slots)} distinct successors need hidden_size >= {len(slots)}")
    embed = np.zeros((config.vocab_size, config.hidden_size), np.float32)
    head = np.zeros((config.hidden_size, config.vocab_size), np.float32)  # ours is [hidden, vocab]
    for token, entry in enumerate(successors):
        embed[token, [slots[successor] for successor in entry]] = 1.0
    for successor, slot in slots.items():
        head[slot, successor] = 10.0
    model = random_decoder(config, seed)

    def constructed(path, x):
        names = {getattr(part, "key", part) for part in path}
        if "embed" in names:
            return embed
        if "lm_head" in names:
            return head
        return x * 0 if names & {"o_proj", "down_proj"} else x

    nnx.update(model, jax.tree_util.tree_map_with_path(constructed, nnx.state(model)))
    save_hf_checkpoint(model, path)
    return model
