"""Ahead-of-time compilation for one NVIDIA H100 on this CPU (no GPU): the MoE experts' grouped matmul as
``jax.lax.ragged_dot`` and as jaxrl's blocked form (``jaxrl.models.moe.GroupedMatmul``), forward and with
its gradient, per-GPU temporaries from ``memory_analysis()``.

Shows what XLA:GPU makes of ``ragged_dot`` (jaxlib 0.10.2: a dense one-hot operand over all experts),
which is why GPUs run the blocked form. Needs the JAX CUDA plugin: run it with .venv-cuda-aot/bin/python.

    .venv-cuda-aot/bin/python bench/gpu_moe_aot.py [--rows 16384 --experts 128 --hidden 2048 --width 768]

Target (issue: GPU AOT): the blocked gradient's temporaries at most ragged_dot's.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

MIB = 2.0 ** 20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16384, help="token-expert assignments, sorted by expert")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.compile.gpus import gpu_devices
    from jaxrl.models.moe import GroupedMatmul

    device = gpu_devices("h100", 1, 1)[0]
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)),
                                            jax.sharding.PartitionSpec())
    lhs = jax.ShapeDtypeStruct((args.rows, args.hidden), jnp.bfloat16, sharding=replicated)
    rhs = jax.ShapeDtypeStruct((args.experts, args.hidden, args.width), jnp.bfloat16, sharding=replicated)
    sizes = jax.ShapeDtypeStruct((args.experts,), jnp.int32, sharding=replicated)
    print(f"1 x {device.device_kind}: {args.rows} rows x {args.experts} experts, {args.hidden} -> {args.width}, "
          "bfloat16; MiB of temporaries")
    temp = {}
    for impl in ("ragged_dot", "blocked"):
        def loss(x, w, g, impl=impl):
            return GroupedMatmul(g, args.rows, jnp.bfloat16, impl=impl)(x, w).sum()
        for name, fn in (("forward", loss), ("gradient", jax.grad(loss, argnums=(0, 1)))):
            temp[impl, name] = jax.jit(fn).lower(lhs, rhs, sizes).compile().memory_analysis().temp_size_in_bytes
            print(f"  {impl:>10} {name:>8}: {temp[impl, name] / MIB:>9,.0f}", flush=True)
    ratio = temp["blocked", "gradient"] / temp["ragged_dot", "gradient"]
    print(f"TARGET blocked_gradient_temp_vs_ragged_dot: {ratio:.3f}x (goal <= 1x) {'met' if ratio <= 1 else 'missed'}")


if __name__ == "__main__":
    main()
