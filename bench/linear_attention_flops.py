"""Compiled FLOPs of a lightning-attention decoder vs the same decoder with softmax attention as T doubles.

Two `Decoder`s identical but for `layer_types` (all "lightning_attention" vs all "full_attention"),
batch 1. Prefill (the hidden states of T tokens): FLOPs, growth of total FLOPs per doubling of T
(linear in T -> 2x, quadratic -> 4x) and growth of FLOPs per token (linear -> 1x, quadratic -> 2x).
Decode: one token's FLOPs against a cache that holds T positions (linear layers: a fixed-size
state, so constant in T; softmax: a KV cache read grows with T); the Qwen3-Next gated DeltaNet
decoder is shown too.

Counts come from `jax.jit(f).lower(...).compile().cost_analysis()`, which counts a while-loop body
once whatever its trip count. Lightning attention's chunked form has no loop (chunks are linked by
an associative scan), so its prefill count is complete; the gated delta rule's chunked form scans
chunks in a loop, so its prefill is not tabulated (its decode step has no loop).

    .venv/bin/python bench/linear_attention_flops.py [--layers 2 --hidden 512 --heads 8 --head-dim 64]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import Decoder, ModelConfig


def flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def build(kind: str, args) -> tuple:
    heads = args.hidden // args.head_dim
    config = ModelConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_layers=args.layers,
        num_heads=heads, num_kv_heads=heads, head_dim=args.head_dim, layer_types=(kind,) * args.layers,
        linear_chunk_size=args.chunk, linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
        linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim,
        max_position_embeddings=1024 * args.max_k + 1,
        # The einsum form: XLA's cost analysis counts a loop body once, not once per trip, so the blockwise
        # ("chunked") softmax's FLOPs would be undercounted and no longer grow as T^2.
        attention_impl="xla")
    return nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))


def prefill_flops(model, length: int) -> float:
    graph, params = model

    def prefill(params, ids):
        positions = jnp.arange(length)[None]
        return nnx.merge(graph, params)(ids, positions).hidden

    return flops(prefill, params, jax.ShapeDtypeStruct((1, length), jnp.int32))


def decode_flops(model, length: int) -> float:
    graph, params = model
    cache = jax.eval_shape(lambda: nnx.merge(graph, params).init_cache(1, length + 1))

    def decode(params, ids, cache):
        positions = jnp.full((1, 1), length)
        return nnx.merge(graph, params)(ids, positions, cache=cache).hidden

    return flops(decode, params, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--max-k", type=int, default=32, help="largest T in thousands (powers of two from 1K)")
    args = parser.parse_args()
    lengths = [1024 * 2**i for i in range(args.max_k.bit_length()) if 2**i <= args.max_k]
    models = {kind: build(kind, args) for kind in ("lightning_attention", "full_attention", "gated_deltanet")}

    print(f"prefill, {args.layers} decoder layers (attention + dense MLP), hidden {args.hidden}, "
          f"heads of {args.head_dim}, chunk {args.chunk}, batch 1")
    print(f"{'T':>6} | {'lightning GFLOP':>15} {'x/doubling':>10} {'per-token x':>11} | "
          f"{'softmax GFLOP':>13} {'x/doubling':>10} {'per-token x':>11} | {'softmax/lightning':>17}")
    previous = None
    for length in lengths:
        lin = prefill_flops(models["lightning_attention"], length)
        soft = prefill_flops(models["full_attention"], length)
        cells = [""] * 4
        if previous:
            cells = [f"{lin / previous[0]:.3f}", f"{lin / previous[0] / 2:.3f}",
                     f"{soft / previous[1]:.3f}", f"{soft / previous[1] / 2:.3f}"]
        print(f"{length:>6} | {lin / 1e9:15.3f} {cells[0]:>10} {cells[1]:>11} | {soft / 1e9:13.3f} {cells[2]:>10} "
              f"{cells[3]:>11} | {soft / lin:17.2f}")
        last_growth = None if previous is None else (lin / previous[0], soft / previous[1])
        previous = (lin, soft)

    print("\ndecode step (one token), MFLOP, with a cache holding T positions")
    print(f"{'T':>6} | {'lightning':>10} {'deltanet':>10} {'softmax':>10}")
    linear_decode = []
    for length in lengths:
        row = [decode_flops(models[kind], length) / 1e6
               for kind in ("lightning_attention", "gated_deltanet", "full_attention")]
        linear_decode.append(row[:2])
        print(f"{length:>6} | " + " ".join(f"{v:10.3f}" for v in row))

    # The targets: a linear prefill grows under 1.1x per doubling of T per token (its total
    # doubles by definition), softmax approaches 4x in total; linear decode FLOPs do not grow with T.
    per_token = last_growth[0] / 2
    print(f"TARGET linear_prefill_growth_per_token: {per_token:.3f}x per doubling at T={lengths[-1]} "
          f"(goal < 1.1x) {'met' if per_token < 1.1 else 'missed'}")
    print(f"(softmax prefill at T={lengths[-1]}: {last_growth[1]:.3f}x per doubling in total, 4x in the limit)")
    growth = max(max(row[i] for row in linear_decode) / min(row[i] for row in linear_decode) for i in range(2))
    print(f"TARGET linear_decode_flops_flat: {growth:.4f}x from T={lengths[0]} to T={lengths[-1]} "
          f"(goal <= 1.01x, no growth with T) {'met' if growth <= 1.01 else 'missed'}")


if __name__ == "__main__":
    main()
