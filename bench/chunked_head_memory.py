"""Peak memory of chunked vs naive LM-head logprob+entropy (forward+backward).

Compiles both for T=8192, d=1024, V=151,936 (bfloat16 inputs, float32
accumulation) and reads XLA's ``memory_analysis()``. Nothing is executed, so
nothing of that size is allocated: the inputs are ``ShapeDtypeStruct``s.

    .venv/bin/python bench/chunked_head_memory.py [--chunk-size N] [--vocab-chunk-size N] [--execute]
    .venv/bin/python bench/chunked_head_memory.py --tokens 4096 --hidden 256 --time-vocab-chunks 32768,16384

Peak = arguments + outputs + temporaries - aliased (what the executable needs
at once). Target (issue 2): chunked <= 1/8 of naive. ``--execute`` (for an
accelerator with room for the naive version, about 25 GiB) also runs both on
random data and prints their time and how far apart their outputs and
gradients are.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from jaxrl.losses.entropy import token_entropy_from_logits, token_logprobs_from_logits
from jaxrl.models.lm_head import token_logprobs_and_entropy


def naive(hidden, lm_head, targets):
    logits = jnp.einsum("btd,dv->btv", hidden, lm_head, preferred_element_type=jnp.float32)
    return token_logprobs_from_logits(logits, targets), token_entropy_from_logits(logits)


def loss_and_grad(head_fn):
    """Forward+backward of a scalar that uses both outputs (as a policy loss + entropy bonus does)."""
    def loss(hidden, lm_head, targets):
        logp, entropy = head_fn(hidden, lm_head, targets)
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)
    return jax.value_and_grad(loss, argnums=(0, 1))


def peak_bytes(fn, *shapes) -> tuple[int, dict[str, int]]:
    stats = jax.jit(fn).lower(*shapes).compile().memory_analysis()
    parts = {
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
    }
    return parts["arguments"] + parts["outputs"] + parts["temporaries"] - parts["aliased"], parts


def execute(fns, shapes) -> None:
    """Runs each compiled forward+backward on the same random inputs: time and agreement."""
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], shapes[0].shape, jnp.float32).astype(shapes[0].dtype)
    lm_head = (jax.random.normal(keys[1], shapes[1].shape, jnp.float32)
               / shapes[1].shape[0] ** 0.5).astype(shapes[1].dtype)
    targets = jax.random.randint(keys[2], shapes[2].shape, 0, shapes[1].shape[1])
    outputs = {}
    for name, fn in fns.items():
        step = jax.jit(fn)
        jax.block_until_ready(step(hidden, lm_head, targets))
        start = time.perf_counter()
        for _ in range(3):
            out = jax.block_until_ready(step(hidden, lm_head, targets))
        print(f"{name:8s} {(time.perf_counter() - start) / 3 * 1e3:8.1f} ms per forward+backward")
        outputs[name] = jax.tree.map(lambda x: x.astype(jnp.float32), out)
    for label, a, b in zip(("loss", "d_hidden", "d_lm_head"), jax.tree.leaves(outputs["chunked"]),
                           jax.tree.leaves(outputs["naive"]), strict=True):
        err = float(jnp.max(jnp.abs(a - b)))
        scale = float(jnp.max(jnp.abs(b)))
        print(f"{label:9s} max |chunked - naive| = {err:.3e} (max |naive| = {scale:.3e})")


def time_vocab_chunks(shapes, chunk_size: int, sizes: list[int], rounds: int = 3) -> None:
    """Forward+backward of the chunked head (float32 head, bfloat16 compute, as the decoder calls it) with each
    vocabulary tile size, interleaved round by round; prints the best time of each and its ratio to the first."""
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], shapes[0].shape, jnp.float32).astype(shapes[0].dtype)
    lm_head = jax.random.normal(keys[1], shapes[1].shape, jnp.float32) / shapes[1].shape[0] ** 0.5
    targets = jax.random.randint(keys[2], shapes[2].shape, 0, shapes[1].shape[1])
    steps = {size: jax.jit(loss_and_grad(functools.partial(
        token_logprobs_and_entropy, chunk_size=chunk_size, vocab_chunk_size=size, compute_dtype=jnp.bfloat16)))
        for size in sizes}
    for step in steps.values():
        jax.block_until_ready(step(hidden, lm_head, targets))
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(rounds):
        for size, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(hidden, lm_head, targets))
            best[size] = min(best[size], time.perf_counter() - start)
    for size in sizes:
        print(f"vocab_chunk_size={size:>6}: {best[size]:7.2f} s per forward+backward "
              f"({best[size] / best[sizes[0]]:.2f}x the first)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--vocab-chunk-size", type=int, default=16384)
    parser.add_argument("--execute", action="store_true", help="also run both (needs ~25 GiB)")
    parser.add_argument("--time-vocab-chunks", default="",
                        help="comma-separated vocabulary tile sizes: time the chunked head with each first")
    args = parser.parse_args()

    shapes = (
        jax.ShapeDtypeStruct((1, args.tokens, args.hidden), jnp.bfloat16),
        jax.ShapeDtypeStruct((args.hidden, args.vocab), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, args.tokens), jnp.int32),
    )

    def chunked(hidden, lm_head, targets):
        return token_logprobs_and_entropy(hidden, lm_head, targets, chunk_size=args.chunk_size,
                                          vocab_chunk_size=args.vocab_chunk_size)

    if args.time_vocab_chunks:
        time_vocab_chunks(shapes, args.chunk_size, [int(size) for size in args.time_vocab_chunks.split(",")])
    gib = 2.0 ** 30
    print(f"T={args.tokens} d={args.hidden} V={args.vocab} bf16 inputs, forward+backward, "
          f"backend={jax.default_backend()}")
    results = {}
    for name, fn in (("naive", naive), ("chunked", chunked)):
        peak, parts = peak_bytes(loss_and_grad(fn), *shapes)
        results[name] = peak
        detail = ", ".join(f"{k} {v / gib:.3f}" for k, v in parts.items())
        print(f"{name:8s} peak {peak / gib:7.3f} GiB  ({detail} GiB)")
    ratio = results['chunked'] / results['naive']
    print(f"chunk_size={args.chunk_size} vocab_chunk_size={args.vocab_chunk_size}: "
          f"chunked/naive = {ratio:.4f} (1/{1 / ratio:.1f})")
    if args.execute:
        execute({"naive": loss_and_grad(naive), "chunked": loss_and_grad(chunked)}, shapes)
    print(f"TARGET chunked_head_peak_memory: 1/{1 / ratio:.1f} of the naive head (goal <= 1/8) "
          f"{'met' if ratio <= 1 / 8 else 'missed'}")


if __name__ == "__main__":
    main()
