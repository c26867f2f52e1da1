"""Learner scoring: the one path by which the learner's logprobs of given tokens are computed.

The trainer's ``old_logp`` / ``ref_logp`` recompute, the alignment checker and the SGLang
weight-push probe all call :class:`LogprobScorer`, so what the checker proves about the
learner is what the trainer uses. Two alignments of the same numbers exist:

- *next-token* (the trainer's packed rows): column ``t`` holds ``log p(targets[t])``, the
  token at position ``t + 1``; inputs are ``input_ids, positions, segment_ids, targets``;
- *token* (the alignment checker's sequences): column ``t`` holds the logprob of token ``t``
  itself, column 0 (the first token, which nothing predicts) holds 0.

:func:`next_token_inputs` turns right-padded token sequences into next-token inputs and
:func:`sequence_logprobs` returns the token-aligned view. Logprobs come from raw logits
(temperature 1, no filtering) through the chunked LM head (``jaxrl.models.lm_head``), in
float32.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.models.packing import pack_rows, unpack
from jaxrl.models.sharding import batch_shardings

DEFAULT_CHUNK_SIZE = 1024


class Scores(NamedTuple):
    """What :meth:`LogprobScorer.score` returns: next-token logprobs and entropy [N, T] float32
    (host arrays) and, when routes were given, ``route_disagreement`` [MoE layers] float32: per MoE
    layer, the fraction of the routed positions whose router top-k (as a set) differs from the
    given routes, whether or not they were replayed (None without routes or without positions)."""

    logp: np.ndarray
    entropy: np.ndarray
    route_disagreement: np.ndarray | None = None


def route_disagreement_counts(own: jax.Array, given: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per layer, how many real positions (``segment_ids > 0``) with recorded routes (every entry
    of ``given`` >= 0) route to a different set of experts than ``given``; and how many positions
    were compared. own, given: [B, T, L, k] int; returns ([L] float32, [] float32)."""
    compared = (segment_ids > 0)[..., None] & jnp.all(given >= 0, axis=-1)  # [B, T, L]
    differ = jnp.any(jnp.sort(own, axis=-1) != jnp.sort(given.astype(own.dtype), axis=-1), axis=-1) & compared
    return jnp.sum(differ, axis=(0, 1), dtype=jnp.float32), jnp.sum(compared[..., 0], dtype=jnp.float32)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("chunk_size", "replicate", "replay"))
def _score(graphdef, params, input_ids, positions, segment_ids, targets, routes, gather, *, chunk_size: int,
           replicate: bool, replay: bool):
    """Next-token logprobs, entropy and route disagreement counts of (packed) rows; with ``gather`` (the
    packing's, else None) the per-token values come back one sample per row."""
    model = nnx.merge(graphdef, params)
    logp, entropy, out = model.token_logprobs(input_ids, positions, segment_ids, targets, chunk_size=chunk_size,
                                              routed_experts=routes if replay else None)
    counts = None if routes is None else route_disagreement_counts(out.router_experts, routes, segment_ids)
    if gather is not None:
        logp, entropy = unpack(logp, gather), unpack(entropy, gather)
    if replicate:  # every process reads the whole result, also when the rows are spread over processes
        logp, entropy, counts = jax.lax.with_sharding_constraint((logp, entropy, counts), PartitionSpec())
    return logp, entropy, counts


class LogprobScorer:
    """Jitted learner recompute of next-token logprobs and entropy [N, T] float32.

    ``scorer(params, input_ids, positions, segment_ids, targets)`` runs ``rows`` sequences at a
    time (bounding activation memory; ``None`` = all at once) with any parameter state of the
    model ``graphdef`` describes (the policy, the frozen reference), placed on ``mesh`` when
    given, and returns host arrays. With ``pack`` each chunk's sequences share rows
    (``jaxrl.models.packing``; ``devices``: the data-parallel devices the rows spread over)
    and the results come back one sequence per row as without. :meth:`score` also takes an MoE
    engine's routes, to replay them (R3) and to measure how often the learner's routers disagree.
    """

    def __init__(self, graphdef: Any, mesh: jax.sharding.Mesh | None = None, rows: int | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, *, pack: bool = False, devices: int = 1):
        self.graphdef, self.mesh, self.rows, self.chunk_size = graphdef, mesh, rows, chunk_size
        self.pack, self.devices = pack, devices

    def __call__(self, params, input_ids, positions, segment_ids, targets) -> tuple[np.ndarray, np.ndarray]:
        return self.score(params, input_ids, positions, segment_ids, targets)[:2]

    def score(self, params, input_ids, positions, segment_ids, targets, *, routed_experts=None,
              replay: bool = False, prefix_groups=None) -> Scores:
        """As calling the scorer; ``routed_experts`` [N, T, MoE layers, k] int (-1 where none): the
        engine's experts at each input position, replayed by the forward when ``replay``, and
        compared with the learner routers' own choice either way (``Scores.route_disagreement``);
        ``prefix_groups`` [N] int (packing only): samples that may share their common leading columns
        (``jaxrl.models.packing.pack_rows``)."""
        if replay and routed_experts is None:
            raise ValueError("routing replay needs routed_experts")
        if prefix_groups is not None and not self.pack:
            raise ValueError("prefix_groups share prompts between packed rows: build the scorer with pack=True")
        inputs = (input_ids, positions, segment_ids, targets)
        n = np.shape(input_ids)[0]
        rows = n if self.rows is None else min(self.rows, n)
        logps, entropies, differ, compared = [], [], 0.0, 0.0
        for start in range(0, n, max(rows, 1)):
            chunk = tuple(np.asarray(x[start:start + rows], np.int32) for x in inputs)
            routes = None if routed_experts is None else np.asarray(routed_experts[start:start + rows], np.int32)
            groups = None if prefix_groups is None else np.asarray(prefix_groups[start:start + rows])
            packed = (pack_rows(*chunk, devices=self.devices, routed_experts=routes, prefix_groups=groups)
                      if self.pack else None)
            gather = None
            if packed is not None:
                chunk, routes, gather = packed.model_inputs(), packed.routed_experts, packed.gather
            logp, entropy, counts = self._score(params, chunk, routes, gather, replay)
            logps.append(np.asarray(logp, np.float32))
            entropies.append(np.asarray(entropy, np.float32))
            if counts is not None:
                differ, compared = differ + np.asarray(counts[0]), compared + float(counts[1])
        disagreement = None if not compared else (differ / compared).astype(np.float32)
        return Scores(np.concatenate(logps), np.concatenate(entropies), disagreement)

    def lower(self, params, rows: int, length: int):
        """``jax.jit(...).lower`` of the program one call runs on ``rows`` unpacked sequences of ``length``
        columns, with ``params`` real or abstract (ShapeDtypeStructs with shardings): ahead-of-time
        compilation for the mesh's devices (``jaxrl compile``)."""
        inputs = (jax.ShapeDtypeStruct((rows, length), jnp.int32),) * 4
        if self.mesh is None:
            return _score.lower(self.graphdef, params, *inputs, None, None, chunk_size=self.chunk_size, replicate=False,
                                replay=False)
        inputs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                       for x, s in zip(inputs, batch_shardings(inputs, self.mesh), strict=True))
        with jax.set_mesh(self.mesh):
            return _score.lower(self.graphdef, params, *inputs, None, None, chunk_size=self.chunk_size, replicate=True,
                                replay=False)

    def _score(self, params, inputs: tuple[np.ndarray, ...], routes, gather, replay: bool):
        if self.mesh is None:
            return _score(self.graphdef, params, *inputs, routes, gather, chunk_size=self.chunk_size,
                          replicate=False, replay=replay)
        with jax.set_mesh(self.mesh):
            placed = (inputs, routes, gather)
            inputs, routes, gather = jax.device_put(placed, batch_shardings(placed, self.mesh))
            return _score(self.graphdef, params, *inputs, routes, gather, chunk_size=self.chunk_size,
                          replicate=True, replay=replay)


def next_token_inputs(token_ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    """Right-padded sequences ``token_ids`` [B, T] of ``lengths`` [B] tokens -> next-token inputs
    ``(input_ids, positions, segment_ids, targets)``, each [B, T - 1] int32: row b's first
    ``lengths[b] - 1`` columns are real (segment id 1), the rest padding (segment id 0)."""
    token_ids = np.asarray(token_ids, np.int32)
    batch, length = token_ids.shape
    positions = np.broadcast_to(np.arange(length - 1, dtype=np.int32), (batch, length - 1))
    segment_ids = (positions < np.asarray(lengths)[:, None] - 1).astype(np.int32)
    return token_ids[:, :-1], np.ascontiguousarray(positions), segment_ids, token_ids[:, 1:]


def token_aligned(next_token: np.ndarray, fill: Any = 0) -> np.ndarray:
    """A next-token-aligned per-token array [B, T - 1] -> token-aligned [B, T]: column t + 1
    holds column t's value, column 0 (the first token, which nothing scores) holds ``fill``."""
    next_token = np.asarray(next_token)
    first = np.full((next_token.shape[0], 1), fill, next_token.dtype)
    return np.concatenate([first, next_token], axis=1)


def sequence_logprobs(model: nnx.Module, token_ids: np.ndarray, lengths: np.ndarray,
                      mesh: jax.sharding.Mesh | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE) -> np.ndarray:
    """The learner's token-aligned logprobs [B, T] float32 of right-padded sequences (column 0
    and the padding hold 0): :class:`LogprobScorer` on :func:`next_token_inputs`."""
    graphdef, params = nnx.split(model)
    inputs = next_token_inputs(token_ids, lengths)
    logp, _ = LogprobScorer(graphdef, mesh, chunk_size=chunk_size)(params, *inputs)
    return token_aligned(np.where(inputs[2] > 0, logp, 0.0).astype(np.float32))


__all__ = ["DEFAULT_CHUNK_SIZE", "LogprobScorer", "Scores", "route_disagreement_counts", "next_token_inputs",
           "sequence_logprobs", "token_aligned"]
