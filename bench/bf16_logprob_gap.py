"""bfloat16 numerics of the embedded sampler against the learner's recompute, on this CPU.

For each seed, a random decoder (``--shape``, weights scaled 10x for peaked, varied next-token
distributions) computes in bfloat16 (``model.dtype: bfloat16``) with float32 master weights, as
the shipped GPU and TPU configs do, and with bfloat16 weights too. Its sampler draws
``--prompts`` x ``--new-tokens`` tokens at temperature 1; the raw logprobs are compared with

- the same model's recompute (the trainer's ``old_logp`` and its push check): both paths round
  to bfloat16 at the same points (the matmul inputs; norms, residual stream, LM head and
  log-softmax in float32), so what is left is float32 reduction order;
- the float32 model's recompute: what one path rounding where the other does not looks like
  (a learner in float32 behind a bfloat16 engine, or a kernel that keeps an input in another
  dtype);
- another seed's model in bfloat16: a wrong checkpoint.

Prints per seed the max and mean |dlogp| against each, the quantiles over every token, and ends
with ``TARGET bf16_mean_gap: <largest mean, same rounding> (goal <= 0.05, rollout.push_tolerance's
default on the mean) met|missed`` and ``TARGET wrong_weights_mean_gap: <smallest mean against
another seed's weights> (goal > 0.05)``: the push check's default in bfloat16
(``rollout.push_check: auto``) passes a right push and stops a wrong one.

    .venv/bin/python bench/bf16_logprob_gap.py [--seeds 8 --shape tiny|small]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from flax import nnx

from jaxrl.align.check import collect, score_with_learner
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.sampler import JaxSampler
from jaxrl.rollout.sglang.testing import random_decoder
from jaxrl.trainer.stages.push import DEFAULT_TOLERANCE

SHAPES = {
    "tiny": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, max_position_embeddings=128),
    "small": dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=2,
                  head_dim=32, max_position_embeddings=256),
}
MAX_TOLERANCE, MEAN_TOLERANCE = DEFAULT_TOLERANCE["max"], DEFAULT_TOLERANCE["mean"]


def with_weights_of(model: Decoder, shape: dict, seed: int, **dtypes) -> Decoder:
    """A model of ``dtypes`` holding ``model``'s weights (cast)."""
    other = Decoder(ModelConfig(**shape, **dtypes), rngs=nnx.Rngs(seed))
    ours = nnx.state(other)
    nnx.update(other, jax.tree.map(lambda mine, theirs: theirs.astype(mine.dtype), ours, nnx.state(model)))
    return other


def gaps(batch) -> np.ndarray:
    mask = np.asarray(batch.model_mask, bool)
    return np.abs(np.asarray(batch.learner_logprobs) - np.asarray(batch.rollout_logprobs))[mask]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, shape["vocab_size"], size=int(n))) for n in rng.integers(2, 12, args.prompts)]
    kinds = ("same rounding", "float32 learner", "wrong weights")
    per_seed = {kind: [] for kind in kinds}  # (max, mean) per seed and weight dtype
    tokens = {kind: [] for kind in kinds}
    print(f"shape {args.shape}: {shape}; {args.prompts} prompts x {args.new_tokens} tokens, temperature 1")
    print("|dlogp| of a bfloat16-compute sampler's tokens against: the same model's recompute (same rounding), the "
          "float32 model's, another seed's (wrong weights); max / mean per seed")
    print(f"{'seed':>4} {'weights':>8} | " + " | ".join(f"{kind:>22}" for kind in kinds))
    for seed in range(args.seeds):
        for weights in ("float32", "bfloat16"):
            model = random_decoder(ModelConfig(**shape, dtype="bfloat16", param_dtype=weights), seed)
            sampler = JaxSampler(model, max_cache_len=64, max_batch=args.prompts)
            batch = collect(sampler, prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens,
                                                             seed=seed))
            learners = {"same rounding": model,
                        "float32 learner": with_weights_of(model, shape, seed, dtype="float32", param_dtype="float32"),
                        "wrong weights": random_decoder(ModelConfig(**shape, dtype="bfloat16", param_dtype=weights),
                                                         seed + 1000)}
            row = []
            for kind, learner in learners.items():
                values = gaps(score_with_learner(learner, batch))
                tokens[kind].append(values)
                per_seed[kind].append((float(values.max()), float(values.mean())))
                row.append(f"{values.max():>10.3g} / {values.mean():<9.3g}")
            print(f"{seed:>4} {weights:>8} | " + " | ".join(row))
    quantiles = (0.5, 0.99, 0.999, 1.0)
    print("quantiles of |dlogp| over every token (" + ", ".join(f"q{q:g}" for q in quantiles) + ")")
    for kind in kinds:
        values = np.concatenate(tokens[kind])
        print(f"  {kind:>15}: " + ", ".join(f"{np.quantile(values, q):.3g}" for q in quantiles))
    same_max = max(m for m, _ in per_seed["same rounding"])
    same_mean = max(mean for _, mean in per_seed["same rounding"])
    wrong_mean = min(mean for _, mean in per_seed["wrong weights"])
    print(f"same rounding: largest max {same_max:.3g}, largest mean {same_mean:.3g}; wrong weights: smallest mean "
          f"{wrong_mean:.3g} ({wrong_mean / same_mean:.3g}x the largest same-rounding mean)")
    print(f"the largest gap where both round alike, {same_max:.3g}, is {same_max / MAX_TOLERANCE:.3g}x the float32 "
          f"default ({MAX_TOLERANCE:g} on the max): in bfloat16 the push check bounds the mean")
    print(f"TARGET bf16_mean_gap: {same_mean:.3g} (goal <= {MEAN_TOLERANCE:g}, rollout.push_tolerance's default on "
          f"the mean) {'met' if same_mean <= MEAN_TOLERANCE else 'missed'}")
    print(f"TARGET wrong_weights_mean_gap: {wrong_mean:.3g} (goal > {MEAN_TOLERANCE:g}) "
          f"{'met' if wrong_mean > MEAN_TOLERANCE else 'missed'}")


if __name__ == "__main__":
    main()
