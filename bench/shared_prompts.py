"""The RL update and the reference forward with each GRPO group's prompt laid out once (``update.share_prefix``).

GRPO groups share their prompt: G samples of one P-token prompt with completions of C tokens.
Three layouts of the same batch run the trainers' own pieces (``StepBatch.mini_batches``,
``rl_loss_fn``, the jitted ``TrainStep``; ``LogprobScorer`` for the reference forward), each
compiled first, then timed alternately in one run so machine noise hits all alike:

- ``rows``: one sample per row (``update.pack: false``);
- ``packed``: several samples per row (``update.pack: true``);
- ``shared``: packed, each group's prompt once (``update.pack`` + ``update.share_prefix``).

Prints, per shape, the rows each layout runs, the columns it computes (real cells), the median
seconds of one update and of one reference forward, and the speed-up of ``shared`` over
``rows`` and over ``packed``. The shapes: ``long-prompt`` (8 prompts of 256 tokens x 8 samples
of 16-96 new tokens: the prompt is most of each sequence, as with system prompts, few-shot
examples or agent histories) and bench/vs_tunix.py's ``large`` work (4 prompts of 16 tokens x 4
samples of 32). The model: 4 layers x hidden 256 (4 heads, 2 kv heads), float32, one CPU device.
It has no target of its own (issue 14's whole-step targets are bench/vs_tunix.py's TARGET lines).

    python bench/shared_prompts.py [--repeats 5]
"""

import argparse
import time

import jax
import numpy as np
import optax
from flax import nnx

from jaxrl.losses import ObjectiveConfig
from jaxrl.models import Decoder, MeshConfig, ModelConfig, make_mesh
from jaxrl.models.scoring import LogprobScorer
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.update import make_train_step, rl_loss_fn

# name: (prompts, group size, prompt tokens, (fewest, most) new tokens)
SHAPES = {"long-prompt": (8, 8, 256, (16, 96)), "vs_tunix-large": (4, 4, 16, (32, 32))}
LAYOUTS = {"rows": (False, False), "packed": (True, False), "shared": (True, True)}


def grpo_batch(prompts: int, group: int, prompt_tokens: int, new_tokens: tuple[int, int], vocab: int,
               seed: int) -> StepBatch:
    """Prompt-major samples: ``group`` completions of each random prompt, lengths uniform in ``new_tokens``."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(1, vocab, prompt_tokens) for _ in range(prompts)]
    samples = [(heads[p], rng.integers(1, vocab, rng.integers(new_tokens[0], new_tokens[1] + 1)))
               for p in range(prompts) for _ in range(group)]
    length = prompt_tokens + new_tokens[1] - 1
    logp = [-rng.random(len(c)).astype(np.float32) for _, c in samples]
    batch = StepBatch.pack([p for p, _ in samples], [c for _, c in samples], length, 0, rollout_logp=logp)
    advantages = rng.normal(size=(batch.rows, 1)).astype(np.float32) * batch.mask
    return batch.replace(old_logp=batch.rollout_logp, ref_logp=batch.rollout_logp, advantages=advantages)


def seconds(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def measure(shape: str, config: ModelConfig, repeats: int) -> None:
    prompts, group, prompt_tokens, new_tokens = SHAPES[shape]
    batch = grpo_batch(prompts, group, prompt_tokens, new_tokens, config.vocab_size, seed=0)
    mesh = make_mesh(MeshConfig())
    objective = ObjectiveConfig(kl_kind="k3-as-loss", kl_coef=0.04)
    step, state = make_train_step(Decoder(config, rngs=nnx.Rngs(0)), optax.adamw(1e-5),
                                  rl_loss_fn(objective, seed=0, micro_batches=1, chunk_size=1024), mesh)
    reference = jax.tree.map(np.asarray, state["params"])
    minis = {name: next(batch.mini_batches(1, "token-mean", 0, pack=pack, share_prefix=share))
             for name, (pack, share) in LAYOUTS.items()}
    scorers = {name: LogprobScorer(step.graphdef, pack=pack) for name, (pack, _) in LAYOUTS.items()}
    groups = {name: {"prefix_groups": batch.prompt_groups()} if share else {}
              for name, (_, share) in LAYOUTS.items()}
    holder = {"state": state}

    def update(name):
        holder["state"], metrics = step(holder["state"], minis[name])
        return metrics

    def score(name):
        return scorers[name].score(reference, *batch.model_inputs(), **groups[name]).logp

    for name in LAYOUTS:  # compile every program before timing any
        update(name), score(name)
    times = {name: {"update": [], "reference": []} for name in LAYOUTS}
    for _ in range(repeats):
        for name in LAYOUTS:
            times[name]["update"].append(seconds(lambda name=name: update(name)))
            times[name]["reference"].append(seconds(lambda name=name: score(name)))
    print(f"\n== {shape}: {prompts} prompts of {prompt_tokens} tokens x {group} samples of {new_tokens[0]}-"
          f"{new_tokens[1]} new tokens; {batch.num_tokens} real columns in rows of {batch.input_ids.shape[1]}")
    print(f"   {'layout':<8}{'rows':>10}{'cells run':>11}{'update s':>10}{'reference s':>13}")
    medians = {}
    for name, mini in minis.items():
        rows = (batch.rows, batch.input_ids.shape[1]) if mini.packed is None else mini.packed.input_ids.shape
        cells = batch.num_tokens if mini.packed is None else mini.packed.real_cells
        medians[name] = {k: float(np.median(v)) for k, v in times[name].items()}
        print(f"   {name:<8}{f'{rows[0]} x {rows[1]}':>10}{cells:>11}{medians[name]['update']:>10.4f}"
              f"{medians[name]['reference']:>13.4f}")
    for other in ("rows", "packed"):
        ratios = ", ".join(f"{k} {medians[other][k] / medians['shared'][k]:.2f}x" for k in ("update", "reference"))
        print(f"   shared over {other}: {ratios}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=512, rope_theta=1e6,
                         tie_word_embeddings=False)
    print(f"backend {jax.default_backend()}; model: 4 layers x hidden 256, float32")
    for shape in SHAPES:
        measure(shape, config, args.repeats)
    # Issue 14's targets are whole-step ratios against Tunix: bench/vs_tunix.py prints those TARGET lines.
    print("\nno TARGET of its own: it shows where update.share_prefix pays (the whole-step targets are "
          "bench/vs_tunix.py's)")


if __name__ == "__main__":
    main()
