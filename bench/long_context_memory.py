"""Compiled peak memory of one Qwen3-style train step at long context: xla vs chunked attention.

A small-width model with the real Qwen3 vocabulary (151,936) and the chunked LM head, one
sequence of T tokens, T = 4K, 8K, ..., 64K. Only compiles (inputs are abstract): the figures are
XLA's ``memory_analysis()`` of the whole step (forward, backward, AdamW), so nothing of that size
is allocated and the numbers are deterministic. Per device: with ``--sequence 8`` the step runs
on 8 CPU devices with the mesh's ``sequence`` axis sharding the tokens.

    python bench/long_context_memory.py [--max-length 65536] [--sequence 8] [--logprob-chunk-size 1024]

Targets (issue: long context): chunked temporaries grow at most 2.2x per doubling of T (xla
~4x); at the longest T with ``sequence=8`` the per-device temporaries are at most 1/6 of the
one-device chunked figure.
"""

import argparse
import functools
import os
import sys

# The host devices must exist before JAX starts: as many as --sequence asks for (8 by default).
DEVICES = sys.argv[sys.argv.index("--sequence") + 1] if "--sequence" in sys.argv else "8"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models import Decoder, MeshConfig, ModelConfig, make_mesh  # noqa: E402
from jaxrl.trainer.update import abstract_train_state, build_train_step  # noqa: E402

GROWTH_GOAL, SHARD_GOAL = 2.2, 1 / 6
MIB = 2.0 ** 20


def loss_fn(model, batch, chunk_size: int):
    logp, entropy, _ = model.token_logprobs(batch["ids"], batch["positions"], batch["segments"], batch["ids"],
                                            chunk_size=chunk_size)
    return -jnp.mean(logp) - 0.01 * jnp.mean(entropy), {}


def temporaries(config: ModelConfig, length: int, mesh_config: MeshConfig, chunk_size: int) -> float:
    """MiB of temporaries of one compiled train step on one sequence of ``length`` tokens (per device)."""
    mesh = make_mesh(mesh_config)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    step = build_train_step(graphdef, params, optax.adamw(1e-5), functools.partial(loss_fn, chunk_size=chunk_size),
                            mesh)
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    batch = {"ids": tokens, "positions": tokens, "segments": tokens}
    return step.lower(abstract_train_state(step, params), batch).compile().memory_analysis().temp_size_in_bytes / MIB


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-length", type=int, default=65536)
    parser.add_argument("--sequence", type=int, default=int(DEVICES))
    # the trainers' default update.logprob_chunk_size; its [chunk, 16384] float32 LM-head tiles are a
    # per-device constant that sequence sharding does not divide
    parser.add_argument("--logprob-chunk-size", type=int, default=1024)
    args = parser.parse_args()
    lengths = [4096 * 2 ** i for i in range(16) if 4096 * 2 ** i <= args.max_length]
    base = dict(vocab_size=151_936, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=8,
                num_kv_heads=8, head_dim=64, max_position_embeddings=args.max_length, dtype="bfloat16")
    print(f"backend {jax.default_backend()}; Qwen3-style d=128, 2 layers, 8 heads, V=151,936, chunked LM head; "
          f"logprob chunk {args.logprob_chunk_size}; MiB of temporaries of one train step on one sequence")
    table = {}
    for impl in ("xla", "chunked"):
        config = ModelConfig(**base, attention_impl=impl)
        for length in lengths:
            table[impl, 1, length] = temporaries(config, length, MeshConfig(), args.logprob_chunk_size)
        if args.sequence > 1:
            sharded = MeshConfig(sequence=args.sequence)
            table[impl, args.sequence, lengths[-1]] = temporaries(config, lengths[-1], sharded, args.logprob_chunk_size)
    print(f"{'T':>7}" + "".join(f"{impl:>12}{'x/doubling':>12}" for impl in ("xla", "chunked")))
    for i, length in enumerate(lengths):
        cells = ""
        for impl in ("xla", "chunked"):
            value = table[impl, 1, length]
            growth = value / table[impl, 1, lengths[i - 1]] if i else float("nan")
            cells += f"{value:>12.0f}{growth:>12.2f}"
        print(f"{length:>7}{cells}")
    growth = max(table["chunked", 1, b] / table["chunked", 1, a] for a, b in zip(lengths, lengths[1:], strict=False))
    print(f"TARGET chunked_growth_per_doubling: {growth:.2f}x (goal <= {GROWTH_GOAL}x) "
          f"{'met' if growth <= GROWTH_GOAL else 'missed'}")
    if args.sequence > 1:
        longest = lengths[-1]
        for impl in ("xla", "chunked"):
            print(f"T={longest} {impl}: one device {table[impl, 1, longest]:.0f} MiB, "
                  f"per device with sequence={args.sequence} {table[impl, args.sequence, longest]:.0f} MiB")
        ratio = table["chunked", args.sequence, longest] / table["chunked", 1, longest]
        print(f"TARGET sequence_parallel_memory: {ratio:.3f} of one device (goal <= {SHARD_GOAL:.3f}) "
              f"{'met' if ratio <= SHARD_GOAL else 'missed'}")


if __name__ == "__main__":
    main()
