"""Compiled train-step FLOPs of a Qwen3-MoE model vs an equivalent dense model holding all experts.

The dense model runs every token through one SwiGLU of width E * moe_intermediate_size (all
experts' weights). For the MLP alone the ratio should be k/E; for the whole step it is
(other + k/E * mlp) / (other + mlp), printed as "expected". The MoE step is measured with both
grouped-matmul paths of `jaxrl.models.layers.GroupedMatmul`: `jax.lax.ragged_dot` and the
blocked form (XLA:CPU rewrites ragged_dot into a dense all-groups dot, so the model uses the
blocked form there). `--time` also runs each step and prints milliseconds (median of 5).

    python bench/moe_flops.py [--time] [--batch 4 --length 256 --hidden 256 --experts 16 --width 256]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl.models import Decoder, MeshConfig, ModelConfig, create_sharded_model, make_mesh
from jaxrl.models import layers
from jaxrl.trainer.update import make_train_step


def measure_step(config: ModelConfig, batch_size: int, length: int, run: bool) -> tuple[float, float]:
    """(compiled FLOPs, median ms per step or nan) of one SGD train step."""
    mesh = make_mesh(MeshConfig())
    model, _ = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(0)), mesh)

    def loss_fn(model, batch):
        logp, _, out = model.token_logprobs(batch["ids"], batch["positions"], None, batch["ids"], chunk_size=1024)
        return -jnp.mean(logp) + config.router_aux_loss_coef * out.aux_loss, {}

    step, state = make_train_step(model, optax.sgd(0.1), loss_fn, mesh)
    rng = np.random.default_rng(0)
    batch = {"ids": jnp.asarray(rng.integers(0, config.vocab_size, (batch_size, length)), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch_size, length))}
    flops = step.lower(state, batch).compile().cost_analysis()["flops"]
    if not run:
        return flops, float("nan")
    times = []
    for _ in range(6):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return flops, 1000 * float(np.median(times[1:]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--time", action="store_true", help="also run and time each step")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--width", type=int, default=256, help="moe_intermediate_size")
    args = parser.parse_args()
    tokens, experts, width = args.batch * args.length, args.experts, args.width
    print(f"backend {jax.default_backend()}, tokens {tokens}, hidden {args.hidden}, "
          f"E={experts} experts of width {width}")
    common = dict(vocab_size=1024, hidden_size=args.hidden, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=args.hidden // 4)
    dense_flops, dense_ms = measure_step(ModelConfig(**common, intermediate_size=experts * width),
                                         args.batch, args.length, args.time)
    mlp_flops = 2 * 3 * 3 * tokens * args.hidden * experts * width * common["num_layers"]  # 3 matmuls, fwd + 2 bwd
    print(f"dense all-experts train step: {dense_flops:.4g} FLOPs (MLP ~{mlp_flops:.4g}), {dense_ms:.1f} ms")
    print(f"{'k':>3} {'k/E':>7} {'expected':>9} | {'grouped matmul':>14} {'FLOPs':>10} {'MoE/dense':>10} "
          f"{'ms':>8} {'ms/dense':>9}")
    for k in (1, 2, 4):
        moe = ModelConfig(**common, intermediate_size=1, mlp_types=("moe",) * 2, num_experts=experts,
                          num_experts_per_tok=k, moe_intermediate_size=width)
        expected = (dense_flops - mlp_flops + mlp_flops * k / experts) / dense_flops
        for path, use_ragged_dot in (("ragged_dot", True), ("blocked", False)):
            layers.ragged_dot_is_sparse = lambda use=use_ragged_dot: use  # choose the path for this run
            flops, ms = measure_step(moe, args.batch, args.length, args.time)
            print(f"{k:>3} {k / experts:>7.4f} {expected:>9.4f} | {path:>14} {flops:>10.4g} "
                  f"{flops / dense_flops:>10.4f} {ms:>8.1f} {ms / dense_ms:>9.3f}")


if __name__ == "__main__":
    main()
