"""Real tokens per second of the SFT step and of the RL update, with and without sequence packing.

Lengths come from a long-tailed mix (log-normal, about a 10x spread between short and long
samples, clipped to the row length), as RL responses and SFT pairs have. Without packing every
sample pads to the row length; with packing (``jaxrl.models.packing``) several share a row.
Both variants run the trainers' own pieces (``StepBatch.mini_batches``, the SFT loss,
``rl_loss_fn``, the jitted ``TrainStep``), compiled first, then timed alternately in one run
so machine noise hits both alike. Real tokens = the samples' non-padding tokens.

    python bench/packing_throughput.py [--samples 64] [--length 512] [--repeats 5]
"""

import argparse
import time

import jax
import numpy as np
import optax
from flax import nnx

from jaxrl.losses import ObjectiveConfig
from jaxrl.models import Decoder, MeshConfig, ModelConfig, make_mesh
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.sft import _sft_micro_loss
from jaxrl.trainer.update import accumulate, make_train_step, rl_loss_fn

GOAL = 1.5


def lengths_mix(samples: int, length: int, seed: int) -> np.ndarray:
    """Log-normal lengths with the 5th-95th percentile spread about 10x, within [8, length]."""
    rng = np.random.default_rng(seed)
    sigma = np.log(10.0) / (2 * 1.645)
    raw = rng.lognormal(mean=np.log(length / 6), sigma=sigma, size=samples)
    return np.clip(raw.astype(int), 8, length + 1)


def rl_batch(lengths: np.ndarray, length: int, vocab: int, seed: int) -> StepBatch:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, 4) for _ in lengths]
    completions = [rng.integers(1, vocab, n - 4) for n in lengths]
    logp = [-rng.random(n - 4).astype(np.float32) for n in lengths]
    batch = StepBatch.pack(prompts, completions, length, 0, rollout_logp=logp)
    advantages = rng.normal(size=(len(lengths), 1)).astype(np.float32) * batch.mask
    return batch.replace(old_logp=batch.rollout_logp, advantages=advantages)


def timed(step, state, batch, repeats: int) -> tuple[float, object]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = ModelConfig(vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, max_position_embeddings=args.length + 1)
    mesh = make_mesh(MeshConfig())
    lengths = lengths_mix(args.samples, args.length, seed=0)
    batch = rl_batch(lengths, args.length, config.vocab_size, seed=1)
    real = batch.num_tokens
    print(f"backend {jax.default_backend()}; {args.samples} samples, rows of {args.length}; lengths "
          f"p5={np.percentile(lengths, 5):.0f} median={np.median(lengths):.0f} p95={np.percentile(lengths, 95):.0f}; "
          f"real tokens {real} of {batch.rows * args.length} ({real / (batch.rows * args.length):.0%})")
    losses = {"sft": accumulate(_sft_micro_loss, args.micro_batches),
              "rl": rl_loss_fn(ObjectiveConfig(), seed=0, micro_batches=args.micro_batches, chunk_size=1024)}
    ratios = {}
    print(f"{'step':<6}{'packing':<9}{'rows':>6}{'padding':>9}{'seconds':>10}{'real tokens/s':>15}")
    for name, loss_fn in losses.items():
        model = Decoder(config, rngs=nnx.Rngs(0))
        step, state = make_train_step(model, optax.adamw(1e-5), loss_fn, mesh)
        variants = {pack: next(batch.mini_batches(1, "token-mean", 0, pack=pack, micro_batches=args.micro_batches))
                    for pack in (False, True)}
        for variant in variants.values():  # compile both before timing either
            _, state = timed(step, state, variant, 1)
        seconds = {False: [], True: []}
        for _ in range(args.repeats):
            for pack, variant in variants.items():
                t, state = timed(step, state, variant, 1)
                seconds[pack].append(t)
        for pack, variant in variants.items():
            rows = variant.packed.input_ids.shape[0] if pack else batch.rows
            padding = variant.packed.padding_fraction if pack else 1 - real / (batch.rows * args.length)
            median = float(np.median(seconds[pack]))
            print(f"{name:<6}{'on' if pack else 'off':<9}{rows:>6}{padding:>9.1%}{median:>10.3f}{real / median:>15.0f}")
        ratios[name] = float(np.median(seconds[False]) / np.median(seconds[True]))
    for name, ratio in ratios.items():
        print(f"TARGET packing_speedup_{name}: {ratio:.2f}x real tokens/s (goal >= {GOAL}x) "
              f"{'met' if ratio >= GOAL else 'missed'}")


if __name__ == "__main__":
    main()
