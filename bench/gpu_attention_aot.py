"""Ahead-of-time compilation for one NVIDIA H100 on this CPU (no GPU): per-GPU memory of a Qwen3 1B-class
train step with ``cudnn``, ``chunked`` and ``xla`` attention at T = 4K ... 64K, and of the embedded
sampler's prefill + decode program at 8K and 32K contexts, from ``memory_analysis()``.

Proves the GPU programs compile (cuDNN's fused attention custom calls in the train step) and how their
memory grows with T; nothing runs on a GPU, so tokens/s needs one (bench/gpu_checks.sh). Needs the JAX
CUDA plugin: run it with .venv-cuda-aot/bin/python (bash scripts/setup_cuda_aot.sh).

    .venv-cuda-aot/bin/python bench/gpu_attention_aot.py [--layers 4] [--lengths 4096,...,65536]

The train step: bench/_aot_steps.py (a 1B-class width with ``--layers`` of its 28 layers, one row of T
tokens, full remat). The sampler: the same model decoding ``--new-tokens`` tokens for ``--rows`` rows
after a prompt filling the context. Target (issue: GPU AOT): cuDNN's train-step temporaries grow at most
2.2x per doubling of T (linear activations, no O(T^2) scores).
"""

import argparse
import itertools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IMPLS = ("cudnn", "chunked", "xla")
GOAL_PER_DOUBLING = 2.2


def sampler_memory(device, context: int, layers: int, rows: int, new_tokens: int):
    """``(temporaries, KV cache)`` bytes of the compiled sampler program for ``rows`` rows of a
    ``context - new_tokens``-token prompt decoding ``new_tokens`` tokens."""
    import numpy as np
    from flax import nnx

    from _aot_steps import one_b_config
    from jaxrl.models import Decoder, MeshConfig, make_mesh
    from jaxrl.rollout.sampler import JaxSampler

    config = one_b_config(context, layers, "auto", "none")
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    mesh = make_mesh(MeshConfig(data=1), [device])
    sampler = JaxSampler(model, mesh=mesh, max_batch=rows)
    memory = sampler.lower(rows, 1, context - new_tokens, new_tokens).compile().memory_analysis()
    cache = 2 * layers * rows * context * config.num_kv_heads * config.head_dim * np.dtype("bfloat16").itemsize
    return memory.temp_size_in_bytes, cache


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--rows", type=int, default=8, help="sampler rows decoded at once")
    parser.add_argument("--new-tokens", type=int, default=512)
    args = parser.parse_args()

    from _aot_steps import GIB, train_step_memory
    from jaxrl.compile.gpus import gpu_devices

    devices = gpu_devices("h100", 1, 1)
    print(f"1 x {devices[0].device_kind}; Qwen3 1B-class width, {args.layers} layers; one compiled train step, "
          "one row of T tokens: GiB of temporaries (arguments + temporaries)")
    lengths = [int(x) for x in args.lengths.split(",")]
    temp = {}
    print(f"{'T':>7}" + "".join(f"{impl:>24}" for impl in IMPLS))
    for length in lengths:
        cells = []
        for impl in IMPLS:
            try:
                total, temp[impl, length], hlo = train_step_memory(devices, length, args.layers, impl)
                fused = "__cudnn$fmhaSoftmaxBackward" in hlo
                cells.append(f"{temp[impl, length] / GIB:.2f} ({total / GIB:.2f}){' fmha' if fused else ''}")
            except Exception as error:  # a program that does not lower or compile is a result, reported
                cells.append(f"failed: {type(error).__name__}")
        print(f"{length:>7}" + "".join(f"{c:>24}" for c in cells), flush=True)
    for impl in IMPLS:
        ratios = [temp[impl, b] / temp[impl, a] for a, b in itertools.pairwise(lengths)
                  if (impl, a) in temp and (impl, b) in temp]
        print(f"{impl:>8}: temporaries per doubling of T " + ", ".join(f"{r:.2f}x" for r in ratios))

    print(f"sampler: {args.rows} rows, a prompt filling the context but {args.new_tokens} decoded tokens; GiB")
    for context in (int(x) for x in args.contexts.split(",")):
        program_temp, cache = sampler_memory(devices[0], context, args.layers, args.rows, args.new_tokens)
        print(f"  context {context:>6}: temporaries {program_temp / GIB:.2f} (the bfloat16 KV cache alone "
              f"{cache / GIB:.2f}; x{program_temp / cache:.2f})", flush=True)

    pairs = [(a, b) for a, b in itertools.pairwise(lengths) if ("cudnn", a) in temp and ("cudnn", b) in temp]
    worst = max((temp["cudnn", b] / temp["cudnn", a] for a, b in pairs), default=float("inf"))
    met = len(pairs) == len(lengths) - 1 and worst <= GOAL_PER_DOUBLING
    print(f"TARGET cudnn_memory_per_doubling: {worst:.2f}x (goal <= {GOAL_PER_DOUBLING}x) "
          f"{'met' if met else 'missed'}")


if __name__ == "__main__":
    main()
