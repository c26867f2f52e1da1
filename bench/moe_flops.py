"""Compiled train-step FLOPs of a Qwen3-MoE model vs an equivalent dense model holding all experts.

The dense model runs every token through one SwiGLU of width E * moe_intermediate_size (all
experts' weights). For the MLP alone the ratio should be k/E; for the whole step it is
(other + k/E * mlp) / (other + mlp), printed as "expected". Also prints the grouped matmul
(`jax.lax.ragged_dot`) alone vs its ideal sum-of-groups FLOPs, which tells whether this
backend lowers ragged_dot sparsely (XLA:CPU rewrites it to a dense all-groups dot).

    python bench/moe_flops.py            # on whatever backend JAX finds
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl.models import Decoder, MeshConfig, ModelConfig, create_sharded_model, make_mesh, make_train_step

BATCH, LENGTH = 4, 256
HIDDEN, EXPERTS, EXPERT_WIDTH = 256, 16, 256


def step_flops(config: ModelConfig) -> float:
    mesh = make_mesh(MeshConfig())
    model, _ = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(0)), mesh)

    def loss_fn(model, batch):
        logp, _, out = model.token_logprobs(batch["ids"], batch["positions"], None, batch["ids"], chunk_size=1024)
        return -jnp.mean(logp) + config.router_aux_loss_coef * out.aux_loss, {}

    step, state = make_train_step(model, optax.sgd(0.1), loss_fn, mesh)
    batch = {"ids": jnp.zeros((BATCH, LENGTH), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (BATCH, LENGTH))}
    return step.lower(state, batch).compile().cost_analysis()["flops"]


def grouped_matmul_flops(tokens: int, k: int) -> tuple[float, float]:
    lhs = jnp.ones((tokens * k, HIDDEN))
    rhs = jnp.ones((EXPERTS, HIDDEN, EXPERT_WIDTH))
    sizes = jnp.full((EXPERTS,), tokens * k // EXPERTS, jnp.int32)
    compiled = jax.jit(jax.lax.ragged_dot).lower(lhs, rhs, sizes).compile()
    return compiled.cost_analysis()["flops"], 2.0 * tokens * k * HIDDEN * EXPERT_WIDTH


def main():
    print(f"backend {jax.default_backend()}, tokens {BATCH * LENGTH}, hidden {HIDDEN}, "
          f"E={EXPERTS} experts of width {EXPERT_WIDTH}")
    common = dict(vocab_size=1024, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
    dense = ModelConfig(**common, intermediate_size=EXPERTS * EXPERT_WIDTH)
    dense_flops = step_flops(dense)
    tokens = BATCH * LENGTH
    mlp_flops = 2 * 3 * 3 * tokens * HIDDEN * EXPERTS * EXPERT_WIDTH * common["num_layers"]  # 3 matmuls, fwd + 2 bwd
    print(f"dense all-experts train step: {dense_flops:.4g} FLOPs (of which MLP ~{mlp_flops:.4g})")
    print(f"{'k':>3} {'k/E':>7} {'MoE step FLOPs':>15} {'MoE/dense':>10} {'expected':>9} "
          f"{'ragged_dot FLOPs/ideal':>23}")
    for k in (1, 2, 4):
        moe = ModelConfig(**common, intermediate_size=1, mlp_types=("moe",) * 2, num_experts=EXPERTS,
                          num_experts_per_tok=k, moe_intermediate_size=EXPERT_WIDTH)
        moe_flops = step_flops(moe)
        expected = (dense_flops - mlp_flops + mlp_flops * k / EXPERTS) / dense_flops
        grouped, ideal = grouped_matmul_flops(tokens, k)
        print(f"{k:>3} {k / EXPERTS:>7.4f} {moe_flops:>15.4g} {moe_flops / dense_flops:>10.4f} {expected:>9.4f} "
              f"{grouped / ideal:>23.2f}")


if __name__ == "__main__":
    main()
