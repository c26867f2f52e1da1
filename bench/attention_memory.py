"""Compiled memory of softmax attention forward+backward: `xla` (full scores) versus `chunked` (blockwise).

Compiles `jax.grad` of `sum(attention(q, k, v))` for each T and reads XLA's `memory_analysis()`
(temporaries: what the attention itself needs beyond its inputs and gradients). Nothing runs: the
inputs are `ShapeDtypeStruct`s, so T = 32K costs nothing on CPU.

    .venv/bin/python bench/attention_memory.py [--lengths 2048 4096 8192] [--block-size 512] [--dtype bfloat16]

Target (issue 13): chunked temporaries grow at most 2.2x per doubling of T (xla's grow about 4x).
"""

import argparse
import functools
import math

import jax
import jax.numpy as jnp

from jaxrl.models.attention import chunked_attention, xla_attention


def temp_bytes(fn, length: int, batch: int, heads: int, groups: int, dim: int, dtype) -> int:
    def loss(q, k, v, slot, seg):
        return jnp.sum(fn(q, k, v, slot, slot, seg, seg, scale=dim ** -0.5, dtype=dtype))

    shape = jax.ShapeDtypeStruct
    args = (shape((batch, length, heads, groups, dim), dtype), shape((batch, length, heads, dim), dtype),
            shape((batch, length, heads, dim), dtype), shape((batch, length), jnp.int32),
            shape((batch, length), jnp.int32))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4, help="query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    impls = {"xla": xla_attention,
             "chunked": functools.partial(chunked_attention, block_q=args.block_size, block_k=args.block_size)}
    print(f"forward+backward temporaries, B={args.batch} K={args.kv_heads} G={args.groups} D={args.head_dim} "
          f"{args.dtype} block={args.block_size} backend={jax.default_backend()}")
    print(f"{'T':>7} " + " ".join(f"{name + ' MiB':>12} {'x prev':>7}" for name in impls))
    previous: dict[str, int] = {}
    prev_length = args.lengths[0]
    growth: dict[str, list[float]] = {name: [] for name in impls}
    for length in args.lengths:
        row = f"{length:>7} "
        for name, fn in impls.items():
            size = temp_bytes(fn, length, args.batch, args.kv_heads, args.groups, args.head_dim, dtype)
            ratio = size / previous[name] if name in previous else float("nan")
            if name in previous:  # per doubling, whatever the step between lengths
                growth[name].append(ratio ** (1 / math.log2(length / prev_length)))
            previous[name] = size
            row += f"{size / 2 ** 20:>12.1f} {ratio:>7.2f} "
        prev_length = length
        print(row)
    worst = max(growth["chunked"], default=float("nan"))
    print(f"per doubling of T: xla {max(growth['xla'], default=float('nan')):.2f}x, chunked {worst:.2f}x (worst step)")
    print(f"TARGET chunked_memory_growth: {worst:.2f}x (goal <= 2.2x per doubling) "
          f"{'met' if worst <= 2.2 else 'missed'}")


if __name__ == "__main__":
    main()
