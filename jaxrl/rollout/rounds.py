"""Long generations in rounds: the embedded sampler's KV cache follows the live sequences.

One jitted call per generation (``jaxrl.rollout.sampler``) holds a dense cache of
``rows x (prompt bucket + new-token bucket)`` from the first step to the last, so a batch whose
samples mostly stop early keeps every row's cache at the longest one's length: at 32K new tokens
with lengths spread log-normally, most of it is rows nobody writes any more.

With ``round_tokens = R`` a generation whose new-token bucket exceeds ``R`` runs in rounds
(``round_schedule``): round 0 is the ordinary call (prefill, then decode) with a cache of ``R``
new-token rows; round ``k >= 1`` decodes steps ``R 2^(k-1) .. R 2^k - 1`` with ``R 2^k`` rows. Between
rounds the host reads which sequences stopped; only the unfinished ones (padded to
``row_bucket`` rows) are copied into a cache twice as long (``regrown``, array by array, each old
array freed once copied), and their next-token logits carried, so no step is repeated and
nothing is prefilled again. A round's cache is therefore sized to ``live rows x (prompt + at most
twice the longest live length)``, and memory follows the batch's real lengths; the peak is the
larger of two successive rounds' caches plus one array.

Numerics: every round runs the same decode step (the same attention over a dense cache, masked
the same way), each token drawn with its own ``fold_in(key, step)``, so a sample's tokens are the
one-call path's; only the batch and cache shapes differ between rounds, which moves XLA's
reduction order by float32 ulps, as a kept cache does (the logprobs match the learner's recompute
as closely as the one-call path's; tests/rollout/test_rounds.py).

Why rounds rather than a paged cache: a page table needs attention that reads a sequence's pages
where they lie; in XLA without a custom kernel that is a gather of every row's pages into a dense
``[rows, S]`` view per layer and step, the very block it was meant to avoid, and a different
attention function from the learner's. Rounds keep the decode step and its numerics and cost one
host sync and one cache copy per doubling (bench/long_generation.py measures rounds against one call).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.rollout.decode import decode_loop, gather_rows, take_and_grow

# Generations up to this many new tokens run as one call of the embedded sampler, longer ones in rounds:
# the default of RolloutConfig.round_tokens and JaxSampler's round_tokens.
DEFAULT_ROUND_TOKENS = 2048


def power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def row_bucket(n: int) -> int:
    """The rows a round runs for ``n`` unfinished sequences: the smallest of 1, 2, 3, 4, 6, 8, 12,
    16, ... (2^k and 3 * 2^(k-1)) >= n, so a round pads at most a third of its rows and a batch size
    compiles at most two programs per power of two."""
    power = power_of_two(n)
    return power * 3 // 4 if power >= 4 and n <= power * 3 // 4 else power


def round_schedule(new_token_bucket: int, round_tokens: int) -> list[tuple[int, int]]:
    """(first step, new-token cache rows) of each round of a generation whose new tokens fit
    ``new_token_bucket``: [(0, R), (R, 2R), (2R, 4R), ..., (bucket / 2, bucket)] with R =
    ``round_tokens`` rounded up to a power of two; one round [(0, bucket)] when the bucket is <= R
    or ``round_tokens`` is 0 (rounds off)."""
    if round_tokens <= 0 or new_token_bucket <= round_tokens:
        return [(0, new_token_bucket)]
    rows = power_of_two(round_tokens)
    schedule = [(0, rows)]
    while rows < new_token_bucket:
        schedule.append((rows, 2 * rows))
        rows *= 2
    return schedule


def regrown(cache, take, cache_len: int, layer_types):
    """``decode.gather_rows`` one array at a time, each old array deleted as soon as its replacement
    is enqueued (PJRT frees it once the copy has read it): the previous and the next round's caches
    are never both whole; the peak is the larger plus one array. The old cache is unusable after."""
    def replaced(x, take, cache_len):
        new = _take_and_grow(x, take, cache_len=cache_len)
        x.delete()  # not donation: an input XLA cannot alias to an output (other shape) is not consumed
        return new

    return gather_rows(cache, take, cache_len, layer_types, per_array=replaced)


_take_and_grow = jax.jit(take_and_grow, static_argnames=("cache_len",))


def _round(graphdef, state, cache, logits, last_routes, take, done, start_positions, keys, first_step, temperature,
           top_k, top_p, stop_ids, max_new_tokens, *, steps: int, feed_last: bool):
    """One later round: ``steps`` decode steps from ``first_step`` over ``cache`` (the rows taken,
    already grown: :func:`regrown`; donated, so the loop writes it in place), from the rows ``take``
    [B'] of the previous round's next-token ``logits`` [B, V] and ``last_routes`` [B, L_moe, k] (None
    for dense models). done, start_positions, keys: [B'] / [B', 2] for the rows taken (done:
    padding rows). Returns ((tokens, raw, processed [B', steps], lengths (this round's), stopped
    [B'], routes [B', steps, L_moe, k] or None), (cache, last routes, next-token logits) for the next
    round)."""
    from flax import nnx  # here, so that the rollout config can import this module without flax

    model = nnx.merge(graphdef, state)
    logits = jax.numpy.take(logits, take, axis=0)
    first_routes = None if last_routes is None else jax.numpy.take(last_routes, take, axis=0)
    d = decode_loop(model, logits, cache, start_positions, done, keys, temperature, top_k, top_p, stop_ids,
                    max_new_tokens, first_routes, new_token_bucket=steps, feed_last=feed_last, first_step=first_step)
    return (d.tokens, d.raw, d.processed, d.lengths, d.stopped, d.routes), (d.cache, d.last_routes, d.logits)


round_jit = jax.jit(_round, static_argnums=(0,), static_argnames=("steps", "feed_last"), donate_argnames=("cache",))


class Generation:
    """A whole generation's host outputs, assembled round by round: tokens, raw and processed
    logprobs [rows, N], lengths [rows], stopped [rows], routes [rows, N, L_moe, k] or None, laid out
    as the one-call path returns them. ``batch``: the rows (of the whole generation) still in the
    batch of the last round, in its order."""

    def __init__(self, first_round: tuple, columns: int):
        tokens, raw, processed, lengths, stopped, routes = (np.asarray(x) if x is not None else None
                                                            for x in first_round)
        rows = tokens.shape[0]

        def widened(x):
            out = np.zeros((rows, columns) + x.shape[2:], x.dtype)
            out[:, :x.shape[1]] = x
            return out

        self.tokens, self.raw, self.processed = widened(tokens), widened(raw), widened(processed)
        self.routes = None if routes is None else widened(routes)
        self.lengths, self.stopped = lengths.copy(), stopped.copy()
        self.batch = np.arange(rows)

    def outputs(self) -> tuple:
        """(tokens, raw, processed, lengths, stopped, routes), the one-call program's host outputs."""
        return self.tokens, self.raw, self.processed, self.lengths, self.stopped, self.routes

    def unfinished(self, max_new_tokens: int) -> np.ndarray:
        """Positions in the last round's batch of the rows that go on (not stopped, under budget)."""
        rows = self.batch
        return np.flatnonzero(~self.stopped[rows] & (self.lengths[rows] < max_new_tokens))

    def add(self, rows: np.ndarray, first_step: int, outputs: tuple) -> None:
        """Records a round over the generation's ``rows`` (the round's first len(rows) batch rows)."""
        tokens, raw, processed, lengths, stopped, routes = outputs
        n, span = len(rows), slice(first_step, first_step + tokens.shape[1])
        self.tokens[rows, span], self.raw[rows, span], self.processed[rows, span] = tokens[:n], raw[:n], processed[:n]
        if self.routes is not None:
            self.routes[rows, span] = routes[:n]
        self.lengths[rows] += lengths[:n]
        self.stopped[rows] = stopped[:n]
        self.batch = rows


def decode_rounds(first_round: tuple, kept: tuple, schedule: list[tuple[int, int]], *, run: Callable,
                  start_positions: np.ndarray, keys: np.ndarray, max_new_tokens: int, cache_rows: Callable[[int], int],
                  on_round: Callable[[int, int], None]) -> Generation:
    """The rounds after round 0 (module doc). first_round: round 0's outputs (tokens, raw, processed,
    lengths, stopped, routes) and ``kept`` its (cache, last routes, next-token logits);
    start_positions [rows], keys [rows, 2]: each row's first new position and PRNG key.
    ``run(kept, take, done, start_positions, keys, first_step, steps=, cache_len=, feed_last=)`` runs
    a round (:func:`regrown`, then ``round_jit``) from ``kept``; ``cache_rows(new_rows)``: a round's cache length;
    ``on_round(rows, cache_len)`` sees the shape of each round run."""
    generation = Generation(distributed.to_host(first_round), schedule[-1][1])
    for first_step, new_rows in schedule[1:]:
        going = generation.unfinished(max_new_tokens)
        if going.size == 0:
            break
        take = np.zeros(row_bucket(going.size), np.int32)
        take[:going.size] = going
        rows = generation.batch[take]
        done = np.arange(take.size) >= going.size
        cache_len = cache_rows(new_rows)
        on_round(take.size, cache_len)
        outputs, kept = run(kept, take, done, start_positions[rows], keys[rows], np.int32(first_step),
                            steps=new_rows - first_step, cache_len=cache_len,
                            feed_last=new_rows < max_new_tokens)
        generation.add(rows[:going.size], first_step, distributed.to_host(outputs))
    return generation


__all__ = ["DEFAULT_ROUND_TOKENS", "Generation", "decode_rounds", "power_of_two", "regrown", "round_jit",
           "round_schedule", "row_bucket"]
