"""Train-step FLOPs and time of a Qwen3-MoE-shaped layer stack vs the dense model holding all experts.

The MoE stack (default E=64 experts, k=8 per token, small width) runs its experts through the
model's grouped matmul (`jaxrl.models.moe.GroupedMatmul`: the blocked form on CPU, ragged_dot
on GPU, megablox gmm on TPU). The dense model runs every token through one SwiGLU of width
E * moe_intermediate_size, i.e. every expert's weights. Both train steps (one SGD step of a
token-logprob loss plus the MoE's load-balancing loss) are compiled and timed in the same run.

Expected FLOPs ratio: (other + k/E * mlp) / (other + mlp), where mlp is the dense model's MLP
share of its compiled step FLOPs and other the rest (attention, projections, norms, head,
optimizer). The MLP share is measured, not assumed: the step is also compiled with the dense MLP
at half width, and since the step's FLOPs are affine in that width, mlp = 2 (F(W) - F(W/2)).
The issue's target is a measured MoE/dense FLOPs ratio within 1.5x of the expected one.

    python bench/moe_step.py [--batch 2 --length 256 --hidden 256 --layers 4 --experts 64 --k 8
                              --width 128 --runs 5] [--ragged-dot]

`--ragged-dot` also compiles the MoE with `jax.lax.ragged_dot` forced, to show what XLA:CPU
makes of it (a dense all-groups dot: about the dense model's FLOPs).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl.models import Decoder, MeshConfig, ModelConfig, create_sharded_model, make_mesh
from jaxrl.models import moe as moe_module
from jaxrl.trainer.update import make_train_step


def measure_step(config: ModelConfig, batch_size: int, length: int, runs: int) -> tuple[float, float]:
    """(compiled FLOPs, median ms over `runs` steps after a warm-up, nan when runs == 0) of one SGD train step."""
    mesh = make_mesh(MeshConfig())
    model, _ = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(0)), mesh)

    def loss_fn(model, batch):
        logp, _, out = model.token_logprobs(batch["ids"], batch["positions"], None, batch["ids"], chunk_size=1024)
        return -jnp.mean(logp) + config.router_aux_loss_coef * out.aux_loss, {}

    step, state = make_train_step(model, optax.sgd(0.1), loss_fn, mesh)
    rng = np.random.default_rng(0)
    batch = {"ids": jnp.asarray(rng.integers(0, config.vocab_size, (batch_size, length)), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch_size, length))}
    compiled = step.lower(state, batch).compile()
    flops = compiled.cost_analysis()["flops"]
    times = []
    for _ in range(runs + 1 if runs else 0):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return flops, 1000 * float(np.median(times[1:])) if runs else float("nan")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--width", type=int, default=128, help="moe_intermediate_size")
    parser.add_argument("--runs", type=int, default=5, help="timed steps per model (0: FLOPs only)")
    parser.add_argument("--ragged-dot", action="store_true", help="also compile the MoE with ragged_dot forced")
    args = parser.parse_args()
    tokens, experts, k, width = args.batch * args.length, args.experts, args.k, args.width
    common = dict(vocab_size=1024, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                  num_kv_heads=2, head_dim=args.hidden // 4)
    dense_width = experts * width
    print(f"backend {jax.default_backend()}, {tokens} tokens, hidden {args.hidden}, {args.layers} layers, "
          f"E={experts} experts of width {width}, k={k}; dense SwiGLU width {dense_width}")

    dense_flops, dense_ms = measure_step(ModelConfig(**common, intermediate_size=dense_width),
                                         args.batch, args.length, args.runs)
    half_flops, _ = measure_step(ModelConfig(**common, intermediate_size=dense_width // 2),
                                 args.batch, args.length, 0)
    mlp = 2 * (dense_flops - half_flops)
    other = dense_flops - mlp
    analytic_mlp = 2 * 3 * 3 * tokens * args.hidden * dense_width * args.layers  # 3 matmuls, fwd + 2 bwd
    expected = (other + k / experts * mlp) / dense_flops
    print(f"dense step FLOPs split: MLP {mlp:.4g} (analytic 3 matmuls x fwd+2 bwd: {analytic_mlp:.4g}), "
          f"other {other:.4g} ({other / dense_flops:.1%})")

    moe = ModelConfig(**common, intermediate_size=1, mlp_types=("moe",) * args.layers, num_experts=experts,
                      num_experts_per_tok=k, moe_intermediate_size=width)
    moe_flops, moe_ms = measure_step(moe, args.batch, args.length, args.runs)
    rows = [("dense (all experts)", dense_flops, dense_ms), ("MoE grouped matmul", moe_flops, moe_ms)]
    if args.ragged_dot:
        moe_module.ragged_dot_is_sparse = lambda: True  # force the ragged_dot path for this compile
        rows.append(("MoE ragged_dot forced", measure_step(moe, args.batch, args.length, 0)[0], float("nan")))
    print(f"{'path':<22} {'step FLOPs':>11} {'/dense':>8} {'ms':>9} {'/dense':>8}")
    for name, flops, ms in rows:
        print(f"{name:<22} {flops:>11.4g} {flops / dense_flops:>8.4f} {ms:>9.1f} {ms / dense_ms:>8.3f}")
    measured = moe_flops / dense_flops
    print(f"k/E {k / experts:.4f}; expected MoE/dense FLOPs (other + k/E mlp)/(other + mlp) {expected:.4f}; "
          f"measured {measured:.4f}")
    print(f"TARGET moe_flops_ratio: {measured / expected:.3f}x of expected (goal <= 1.5x of expected) "
          f"{'met' if measured / expected <= 1.5 else 'missed'}")


if __name__ == "__main__":
    main()
