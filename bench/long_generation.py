"""Long generations on the embedded sampler: KV-cache memory and tokens/s, one dense cache vs rounds.

A batch of ``--rows`` samples whose lengths are log-normal with a 10x spread (5th to 95th
percentile, rows at evenly spaced quantiles; the longest sample makes the full ``L`` = 8K, 16K,
32K tokens, so most end early) is
generated twice side by side: by the one-call program (``round_tokens=0``: one dense
``[rows, prompt + L]`` cache for the whole generation) and in rounds (``round_tokens``,
``jaxrl.rollout.rounds``: each round's cache holds only the unfinished rows).

The lengths are exact: the model is a *length oracle*, a small decoder whose embedding and LM head
make greedy decoding count up (token ``t`` is followed by ``t + 1``; unit vectors of 16 frequencies
keep a logit margin of 4 over any other token), so a prompt ending in ``stop - n`` generates ``n``
tokens and stops. Its layers keep random weights and run in full (the attention reads the whole
cache at every step), so the sampler does its real work; only the next token is planted.

Measured, per length:
- KV-cache bytes (exact array sizes): one call holds ``rows x (prompt bucket + L)`` from start to end;
  rounds peak at the largest round's cache, or while one is regrown array by array (old arrays
  not yet replaced plus new ones);
- compiled peak of the decode programs that ran (``memory_analysis()``: arguments + outputs +
  temporaries - aliases, weights included; the largest over a generation's programs), at the
  longest length only (it compiles them again);
- tokens/s: generated tokens / (wall time - XLA compile time, summed from jax's compile events).
Ends with ``TARGET kv_cache_memory_at_32k: <rounds/one call> (goal <= 0.5) met|missed``.

    .venv/bin/python bench/long_generation.py [--lengths 8192 16384 32768 --rows 8 --round-tokens 2048]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.decode import gather_rows
from jaxrl.rollout.rounds import round_jit, round_schedule
from jaxrl.rollout.sampler import JaxSampler, _generate_jit

GOAL = 0.5
FREQUENCIES = 16  # periods 2 .. 2^16: token ids up to 65535 stay distinct
MIB = 2.0 ** 20
PROMPT = 16


def oracle_model(vocab: int, layers: int, hidden: int) -> Decoder:
    """A decoder whose greedy continuation of token ``t`` is ``t + 1`` (module doc)."""
    config = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                         num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=2 * vocab,
                         tie_word_embeddings=False, attention_impl="xla")
    model = Decoder(config, rngs=nnx.Rngs(0))
    angles = np.arange(vocab)[:, None] * (2 * np.pi / 2.0 ** np.arange(1, FREQUENCIES + 1))[None, :]
    unit = np.zeros((vocab, hidden), np.float32)
    unit[:, :2 * FREQUENCIES] = np.concatenate([np.cos(angles), np.sin(angles)], axis=1)
    model.embed[...] = jnp.asarray(np.roll(unit, -1, axis=0))  # token t embeds as t + 1's direction
    model.lm_head[...] = jnp.asarray(unit.T)
    return model


def length_mix(rows: int, longest: int) -> np.ndarray:
    """``rows`` lengths at evenly spaced quantiles of a log-normal whose 95th/5th percentile ratio is
    10 (deterministic, the distribution's shape even for a few rows), scaled so the largest is ``longest``."""
    sigma = np.log(10.0) / (2 * 1.6449)
    z = stats.norm.ppf((np.arange(rows) + 0.5) / rows)
    return np.maximum(1, np.round(longest * np.exp(sigma * (z - z.max())))).astype(int)


class CompileClock:
    """Seconds XLA spent compiling since the last ``take()`` (jax's backend-compile events)."""

    def __init__(self):
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.seconds += duration

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def cache_arrays(sampler: JaxSampler, rows: int, cache_len: int) -> list[int]:
    """Bytes of each array of a decode cache of ``rows`` x ``cache_len``, in the order rounds regrow them
    (each layer's keys and values, then the segment ids)."""
    model = nnx.merge(sampler._graphdef, sampler._state)
    cache = jax.eval_shape(lambda: model.init_cache(rows, cache_len, shared_index=True))
    return [x.size * x.dtype.itemsize for x in jax.tree.leaves(cache.layers) + [cache.segment_ids]]


def peak_cache_bytes(sampler: JaxSampler, shapes: list[tuple[int, int]]) -> int:
    """The most cache bytes live at once over a generation's programs of ``shapes`` [(rows, cache
    rows)]: a round's own cache, and while it is regrown array by array (``rounds.regrown``: each old
    array freed once its replacement exists) the old arrays not yet replaced plus the new ones made."""
    peak, old = 0, None
    for shape in shapes:
        new = cache_arrays(sampler, *shape)
        peak = max(peak, sum(new))
        if old is not None:
            peak = max(peak, max(sum(old[i:]) + sum(new[:i + 1]) for i in range(len(new))))
        old = new
    return peak


def compiled_peak(sampler: JaxSampler, shapes: list[tuple[int, int]], new_bucket: int, params) -> float:
    """MiB, the largest compiled (arguments + outputs + temporaries - aliases) over the decode programs
    of ``shapes`` (round 0 then the later rounds, or the one call; the small per-array regrow
    programs between rounds are counted by ``peak_cache_bytes``)."""
    def peak(lowered):
        m = lowered.compile().memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes) / MIB

    graphdef, state = sampler._graphdef, sampler._state
    layer_types = nnx.merge(graphdef, state).config.layer_types
    scalars = sampler._scalars(params)
    schedule = round_schedule(new_bucket, sampler.round_tokens)
    struct = jax.ShapeDtypeStruct
    rows, cache_len = shapes[0]
    first = (struct((rows, PROMPT), jnp.int32), struct((rows,), jnp.int32), struct((rows,), jnp.int32),
             struct((rows, 2), jnp.uint32))
    static = dict(new_token_bucket=schedule[0][1], cache_len=cache_len, keep_cache=len(schedule) > 1)
    peaks = [peak(_generate_jit.lower(graphdef, state, *first, *scalars, **static))]
    kept = jax.eval_shape(lambda *a: _generate_jit(graphdef, state, *a, *scalars, **static), *first)[1]
    for (rows, cache_len), (first_step, new_rows) in zip(shapes[1:], schedule[1:], strict=False):
        take = struct((rows,), jnp.int32)
        cache = jax.eval_shape(lambda c, t, n=cache_len: gather_rows(c, t, n, layer_types), kept[0], take)
        args = (cache, kept[2], kept[1], take, struct((rows,), jnp.bool_), struct((rows,), jnp.int32),
                struct((rows, 2), jnp.uint32), struct((), jnp.int32), *scalars)
        static = dict(steps=new_rows - first_step, feed_last=new_rows < params.max_new_tokens)
        peaks.append(peak(round_jit.lower(graphdef, state, *args, **static)))
        kept = jax.eval_shape(lambda *a, s=static: round_jit(graphdef, state, *a, **s), *args)[1]
    return max(peaks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--round-tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args()
    longest = max(args.lengths)
    vocab = longest + 2 * PROMPT
    stop = vocab - 1
    model = oracle_model(vocab, args.layers, args.hidden)
    samplers = {"one call": JaxSampler(model, max_batch=args.rows, min_prompt_bucket=PROMPT, round_tokens=0),
                "rounds": JaxSampler(model, max_batch=args.rows, min_prompt_bucket=PROMPT,
                                     round_tokens=args.round_tokens)}
    clock = CompileClock()
    print(f"length oracle: {args.layers} layers, d={args.hidden}, vocab {vocab}, float32; {args.rows} rows, "
          f"log-normal lengths (10x spread, longest = L), round_tokens={args.round_tokens}; "
          f"backend {jax.default_backend()}")
    print(f"{'L':>6} {'path':>9} {'KV cache MiB':>13} {'compiled peak MiB':>18} {'tokens/s':>9} "
          f"{'run s':>7} {'compile s':>9}  cache shapes (rows, cache rows)")
    ratio = None
    for length in sorted(args.lengths):
        lengths = length_mix(args.rows, length)
        prompts = [list(range(1, PROMPT)) + [stop - int(n)] for n in lengths]
        params = SamplingParams(temperature=0.0, max_new_tokens=length, stop_token_ids=(stop,))
        cache = {}
        for name, sampler in samplers.items():
            clock.take()
            start = time.perf_counter()
            out = sampler.generate(prompts, params)
            wall = time.perf_counter() - start
            compile_s = clock.take()
            got = np.array([s.output_ids.size for (s,) in out])
            assert np.array_equal(got, lengths), ("the oracle did not generate the planned lengths", got, lengths)
            cache[name] = peak_cache_bytes(sampler, sampler.cache_shapes)
            compiled = (f"{compiled_peak(sampler, sampler.cache_shapes, length, params):18.1f}"
                        if length == longest else f"{'-':>18}")
            clock.take()
            run_s = wall - compile_s
            print(f"{length:>6} {name:>9} {cache[name] / MIB:13.1f} {compiled} {lengths.sum() / run_s:9.0f} "
                  f"{run_s:7.1f} {compile_s:9.1f}  {sampler.cache_shapes}", flush=True)
        ratio = cache["rounds"] / cache["one call"]
        print(f"{length:>6} KV cache rounds / one call: {ratio:.3f}  (lengths: median {int(np.median(lengths))}, "
              f"min {lengths.min()}, max {lengths.max()})", flush=True)
    print(f"TARGET kv_cache_memory_at_{longest // 1024}k: {ratio:.3f} (goal <= {GOAL}) "
          f"{'met' if ratio <= GOAL else 'missed'}")


if __name__ == "__main__":
    main()
