"""cuDNN attention on a GPU: its values and gradients against ``xla`` and ``chunked`` in bfloat16, and the
tokens/s of the three, forward + backward, at 8K and 32K tokens (run by bench/gpu_checks.sh on a lent GPU).

A 1B-class attention (16 query / 8 key-value heads of 128, causal, bfloat16 inputs, float32 softmax), one
row of T tokens whose last eighth is padding (segment id 0): jaxrl's attention functions as the model calls
them (``jaxrl.models.attention.ATTENTION_IMPLS``). Errors are the largest absolute difference over the real
tokens relative to the largest ``xla`` value; ``xla``'s T x T scores do not fit at 32K, so it is compared and
timed at the shorter length only. ``--dry-run`` runs the same on CPU at small T without cuDNN.

    python bench/gpu_attention_check.py [--lengths 8192,32768] [--dry-run]
"""

import argparse
import time

GOAL = 2e-2  # bfloat16 inputs: a few ulps of bf16 (2^-8) on the output's scale


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="CPU, small T, no cuDNN: checks the script itself")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.models.attention import ATTENTION_IMPLS

    lengths = [256, 512] if args.dry_run else [int(x) for x in args.lengths.split(",")]
    impls = ["chunked", "xla"] if args.dry_run else ["cudnn", "chunked", "xla"]
    kv_heads, groups, dim = 8, 2, 128
    print(f"{jax.devices()[0].device_kind}: attention of 16 query / 8 key-value heads of {dim}, bfloat16, causal")

    def loss_and_grads(name, q, k, v, segments, cotangent):
        slots = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), segments.shape)

        def loss(q, k, v):
            out = ATTENTION_IMPLS[name](q, k, v, slots, slots, segments, segments, scale=dim ** -0.5,
                                        dtype=jnp.bfloat16, block_size=512)
            return jnp.sum(out * cotangent), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    worst = 0.0
    for length in lengths:
        keys = jax.random.split(jax.random.key(length), 4)
        q = jax.random.normal(keys[0], (1, length, kv_heads, groups, dim), jnp.bfloat16)
        k, v = (jax.random.normal(key, (1, length, kv_heads, dim), jnp.bfloat16) for key in keys[1:3])
        real = length - length // 8
        segments = (jnp.arange(length) < real).astype(jnp.int32)[None]
        cotangent = jax.random.normal(keys[3], q.shape, jnp.float32) * segments[..., None, None, None]
        results = {}
        for name in impls:
            if name == "xla" and length > 16384 and not args.dry_run:
                continue  # its float32 scores: 16 x T^2 x 4 bytes, 64 GiB at 32K
            step = loss_and_grads(name, q, k, v, segments, cotangent)
            (_, out), grads = step(q, k, v)
            jax.block_until_ready(grads)
            start = time.perf_counter()
            for _ in range(args.repeats):
                jax.block_until_ready(step(q, k, v))
            seconds = (time.perf_counter() - start) / args.repeats
            results[name] = (np.asarray(out[0, :real], np.float32), [np.asarray(g, np.float32) for g in grads])
            print(f"T={length:>6} {name:>8}: forward + backward {seconds * 1e3:8.2f} ms, "
                  f"{length / seconds:,.0f} tokens/s", flush=True)
        reference = "xla" if "xla" in results else "chunked"
        out_ref, grads_ref = results[reference]
        for name, (out, grads) in results.items():
            if name == reference:
                continue
            errors = [np.abs(out - out_ref).max() / np.abs(out_ref).max()] + [
                np.abs(g - r).max() / np.abs(r).max() for g, r in zip(grads, grads_ref, strict=True)]
            if name == impls[0]:  # cudnn, or chunked in a dry run: the implementation under test
                worst = max(worst, *errors)
            print(f"T={length:>6} {name:>8} vs {reference}: relative max error out {errors[0]:.2e}, "
                  f"dq {errors[1]:.2e}, dk {errors[2]:.2e}, dv {errors[3]:.2e}")
    print(f"TARGET {impls[0]}_equals_reference: {worst:.2e} (goal <= {GOAL:.0e} relative) "
          f"{'met' if worst <= GOAL else 'missed'}")


if __name__ == "__main__":
    main()
