"""Compiled FLOPs of linear-attention vs softmax-attention layer stacks as T doubles (not a test).

Prefill: a stack of lightning-attention layers (MiniMax) vs the same stack with Qwen3-Next gated
softmax attention, T = 1K .. 32K, batch 1. Printed: FLOPs, growth of total FLOPs per doubling
(linear -> 2x, softmax -> 4x) and growth of FLOPs per token per doubling (linear -> 1x,
softmax -> 2x). Decode: one token's FLOPs against a state (linear layers: constant in T) or a
KV cache of T positions (softmax: grows with T).

Counts come from `jax.jit(f).lower(...).compile().cost_analysis()`, which counts a while-loop
body once whatever its trip count. Lightning attention's chunked form has no loop (chunks are
linked by an associative scan), so its count is complete; the gated delta rule's chunked form
scans chunks in a loop, so its prefill count would be wrong and it is shown for decode only.

    .venv/bin/python bench/linear_attention_flops.py [--layers 2 --hidden 512 --heads 8 --head-dim 64]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import linear_layers as ll


def flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def build(kind: str, args, rngs: nnx.Rngs):
    if kind == "lightning":
        return [
            ll.LightningAttention(args.hidden, args.heads, args.head_dim, layer_idx=i, num_layers=args.layers,
                                  chunk_size=args.chunk, rngs=rngs)
            for i in range(args.layers)
        ]
    if kind == "delta":
        return [
            ll.GatedDeltaNet(args.hidden, args.heads // 2, args.heads, args.head_dim, args.head_dim,
                             chunk_size=args.chunk, rngs=rngs)
            for _ in range(args.layers)
        ]
    return [ll.GatedAttention(args.hidden, args.heads, args.heads // 2, args.head_dim, rngs=rngs)
            for _ in range(args.layers)]


def prefill_flops(layers, length: int, hidden: int) -> float:
    graph, params = nnx.split(layers)

    def prefill(params, x):
        for layer in nnx.merge(graph, params):
            y, _ = layer(x)
            x = x + y
        return x

    return flops(prefill, params, jax.ShapeDtypeStruct((1, length, hidden), jnp.float32))


def decode_flops(layers, kind: str, length: int, hidden: int) -> float:
    graph, params = nnx.split(layers)
    states = [
        jax.eval_shape(lambda layer=layer: layer.init_state(1, length + 1) if kind == "softmax" else layer.init_state(1))
        for layer in layers
    ]

    def decode(params, x, states):
        for layer, state in zip(nnx.merge(graph, params), states):
            y, _ = layer.decode(x, state)
            x = x + y
        return x

    return flops(decode, params, jax.ShapeDtypeStruct((1, 1, hidden), jnp.float32), states)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--max-k", type=int, default=32, help="largest T in thousands (powers of two from 1K)")
    args = parser.parse_args()
    lengths = [1024 * 2**i for i in range(args.max_k.bit_length()) if 2**i <= args.max_k]
    with nnx.use_eager_sharding(False):
        stacks = {kind: build(kind, args, nnx.Rngs(0)) for kind in ("lightning", "delta", "softmax")}

    print(f"prefill, {args.layers} layers, hidden {args.hidden}, {args.heads} heads x {args.head_dim}, "
          f"chunk {args.chunk}, batch 1")
    print(f"{'T':>6} | {'lightning GFLOP':>15} {'x/doubling':>10} {'per-token x':>11} | "
          f"{'softmax GFLOP':>13} {'x/doubling':>10} {'per-token x':>11} | {'softmax/lightning':>17}")
    previous = None
    for length in lengths:
        lin = prefill_flops(stacks["lightning"], length, args.hidden)
        soft = prefill_flops(stacks["softmax"], length, args.hidden)
        if previous:
            growth = (lin / previous[0], soft / previous[1])
            cells = [f"{growth[0]:10.3f}", f"{growth[0] / 2:11.3f}", f"{growth[1]:10.3f}", f"{growth[1] / 2:11.3f}"]
        else:
            cells = [f"{'':>10}", f"{'':>11}", f"{'':>10}", f"{'':>11}"]
        print(f"{length:>6} | {lin / 1e9:15.3f} {cells[0]} {cells[1]} | {soft / 1e9:13.3f} {cells[2]} {cells[3]} | "
              f"{soft / lin:17.2f}")
        previous = (lin, soft)

    print("\ndecode step (one token), MFLOP, against a state / KV cache holding T positions")
    print(f"{'T':>6} | {'lightning':>10} {'delta':>10} {'softmax':>10}")
    for length in lengths:
        row = [decode_flops(stacks[kind], kind, length, args.hidden) / 1e6 for kind in ("lightning", "delta", "softmax")]
        print(f"{length:>6} | " + " ".join(f"{v:10.3f}" for v in row))


if __name__ == "__main__":
    main()
