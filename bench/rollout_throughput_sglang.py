"""Rollout tokens/s: SGLang (real CPU server, HTTP) vs the embedded JAX sampler, same model and prompts.

    .venv/bin/python bench/rollout_throughput_sglang.py [--prompts 32 --prompt-len 32 --new 64
                                                        --layers 4 --hidden 256 --vocab 1024]

Both engines get one random float32 Qwen3 ``jaxrl.models.Decoder`` (SGLang
loads its HF export), the same prompts and SamplingParams (T = 1, RAW
logprobs, no stop ids, so every sample has exactly ``--new`` tokens). Each
engine runs the batch once to warm up (JIT compile / server warm-up) and then
``--repeats`` times; prints tokens/s of each and the ratio, and the max
|logprob difference| of each engine's samples against the learner's recompute.
Needs scripts/setup_sglang_cpu.sh. On this 2-core CPU both run with whatever
cores are free: SGLang with OMP_NUM_THREADS=1 (see shared notes), JAX with XLA's
default thread pool.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jaxrl.align.check import collect  # noqa: E402
from jaxrl.models import ModelConfig  # noqa: E402
from jaxrl.models.scoring import sequence_logprobs  # noqa: E402
from jaxrl.rollout.base import SamplingParams  # noqa: E402
from jaxrl.rollout.sampler import JaxSampler  # noqa: E402
from jaxrl.rollout.sglang import SGLangEngine, ServerConfig, ServerManager  # noqa: E402
from jaxrl.rollout.sglang.testing import write_random_checkpoint  # noqa: E402


def tokens_per_s(engine, prompts, params, repeats):
    engine.generate(prompts, params)  # warm-up: compile / first batch
    start = time.perf_counter()
    for _ in range(repeats):
        samples = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return repeats * sum(len(s.output_ids) for row in samples for s in row) / elapsed


def max_abs_diff_to_learner(engine, model, prompts, params):
    batch = collect(engine, prompts, params)
    learner = sequence_logprobs(model, batch.token_ids, batch.lengths)
    mask = batch.model_mask.astype(bool)
    return float(np.max(np.abs(learner[mask] - batch.rollout_logprobs[mask])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=31950)
    args = parser.parse_args()
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=max(args.hidden // 128, 1),
                         head_dim=64, max_position_embeddings=1024)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, args.vocab, size=(args.prompts, args.prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_checkpoint(os.path.join(tmp, "model"), config)
        sampler = JaxSampler(model, max_cache_len=args.prompt_len + args.new, max_batch=args.prompts)
        jax_tps = tokens_per_s(sampler, prompts, params, args.repeats)
        jax_diff = max_abs_diff_to_learner(sampler, model, prompts, params)
        manager = ServerManager(ServerConfig(model_path=os.path.join(tmp, "model"), base_port=args.port,
                                             log_dir=os.path.join(tmp, "logs"))).start()
        try:
            engine = SGLangEngine(manager)
            sglang_tps = tokens_per_s(engine, prompts, params, args.repeats)
            sglang_diff = max_abs_diff_to_learner(engine, model, prompts, params)
            engine.close()
        finally:
            manager.stop()
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.new} new tokens each, "
          f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, float32")
    print(f"{'engine':>14} {'tokens/s':>10} {'max|dlogp| vs learner':>22}")
    print(f"{'embedded JAX':>14} {jax_tps:>10.0f} {jax_diff:>22.2e}")
    print(f"{'SGLang (CPU)':>14} {sglang_tps:>10.0f} {sglang_diff:>22.2e}")
    print(f"SGLang / embedded: {sglang_tps / jax_tps:.2f}")


if __name__ == "__main__":
    main()
