"""The jaxrl half of bench/vs_tunix.py: one GRPO step of jaxrl's RLTrainer, timed per step.

Runs in .venv, started by bench/vs_tunix.py:

    .venv/bin/python bench/_jaxrl_side.py --workdir DIR --shape small|large [--warmup 3] \
        [--recompute when_needed|always] [--layout shared|rows]

DIR holds the shared inputs vs_tunix.py wrote: ``tokenizer/`` (a character tokenizer whose
``<eos>`` id equals the model's vocab size, so the sampler can never produce it and every
sample is exactly ``new_tokens`` long), ``prompts.jsonl`` and ``bench.json`` (shapes, step
settings).

What runs, as a user runs it: ``jaxrl.distributed.initialize()`` first, as ``jaxrl train`` runs it
(one process; on CPU it keeps XLA's scratch buffers mapped between calls,
``jaxrl.distributed.host_memory``), then ``jaxrl.trainer.rl.RLTrainer`` built from a ``TrainConfig``
(``model.architecture``: a Qwen3-style decoder with random float32 weights, computing in the
spec's ``dtype``; the embedded JAX sampler; GRPO advantages; PPO clip loss with
``objective.kl_kind=k3-as-loss`` to the frozen reference; one mini-batch, one micro-batch;
AdamW after global-norm clipping;
``rollout.verify_push`` on), one ``train_step_once()`` per step, on one CPU device. The reward is
a ``kind: python`` function (this module's ``reward_fraction``), run by jaxrl's reward worker.
``--recompute`` sets ``update.recompute_old_logp``: ``when_needed`` (the default here) skips the
learner's ``old_logp`` recompute, which is redundant for one on-policy mini-batch from the
embedded sampler (docs/training.md#skipping-a-redundant-recompute), as Tunix skips it with
one GRPO iteration; ``always`` keeps it. The reference forward stays either way. ``--layout``:
``shared`` (the default here) sets ``update.pack`` and ``update.share_prefix``, so the learner's
forwards (reference and update) lay each group's prompt out once (docs/training.md#shared-prompts);
``rows``: one sample per row, as Tunix runs them.

Figures per step, read from the metrics ``train_step_once()`` returns (jaxrl's own stage
clock, ``time.perf_counter``; warm-up steps, which compile, are reported apart: ``info["warmup"]``,
with ``info["startup_s"]`` from the process's start to a built trainer, for the cold start):
- ``step``: ``time/step``, the whole ``train_step_once`` (data, rollout, reward, packing,
  recompute, advantages, update, push check, weight push);
- ``generation``: ``time/rollout``, ``engine.generate`` for all prompts x group samples;
- ``recompute``: ``time/recompute``, the learner's ``old_logp`` and the reference's ``ref_logp``;
- ``update``: ``time/update``, the jitted train step(s) until their metrics are on the host;
- ``other``: step minus rollout, reward, recompute, update and weight_push ("host/other").

Protocol: after the warm-up it prints one JSON line ``{"ready": ...}`` on stdout; then each
``run K`` line on stdin gives one JSON line with K steps' figures; ``quit`` (or EOF) ends it.
Everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

STARTED = time.perf_counter()  # before JAX and jaxrl are imported: info["startup_s"] counts from here

# A kind: python reward: jaxrl's reward worker imports this module (keep the top light).


def reward_fraction(prompt, response, response_ids, row):
    """The reward both sides use: the fraction of the response's characters equal to ``row["target"]``."""
    from jaxrl.reward import RewardResult

    return RewardResult(score=response.count(row["target"]) / max(len(response), 1))


def build_trainer(config):
    """``RLTrainer(config)`` on the bench's inputs (bench/vs_tunix.py ``write_inputs``), whose ``<eos>`` id
    lies outside the model's vocabulary on purpose: no sample can stop early, so both stacks generate
    the same tokens every step. RL never feeds that id to the model (no prompt holds it, no response
    can end with it), so the trainer's refusal of a tokenizer larger than the model
    (``jaxrl.trainer.model.check_vocabulary``, which guards SFT targets and users' tokenizers) is
    lifted for this process."""
    import jaxrl.trainer.rl as rl

    rl.check_vocabulary = lambda *args: None
    return rl.RLTrainer(config, overwrite=True)


def make_config(spec: dict, shape: dict, out: str, recompute: str, layout: str):
    from jaxrl.config import from_dict
    from jaxrl.trainer.config import TrainConfig

    return from_dict(TrainConfig, config_dict(spec, shape, out, recompute, layout))


def config_dict(spec: dict, shape: dict, out: str, recompute: str, layout: str = "rows") -> dict:
    """The TrainConfig of this side as the dict a YAML file would give (bench/async_speedup.py edits it)."""
    architecture = {k: shape[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                          "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps",
                                          "tie_word_embeddings")}
    architecture["max_position_embeddings"] = spec["prompt_tokens"] + spec["new_tokens"]
    return {
        "output_dir": out, "steps": 10**6, "seed": spec["seed"],
        "model": {"architecture": architecture, "init_seed": spec["seed"], "dtype": spec.get("dtype", "float32"),
                  "param_dtype": "float32"},
        "data": {"tokenizer": os.path.join(spec["workdir"], "tokenizer"),
                 "train_files": [os.path.join(spec["workdir"], "prompts.jsonl")], "use_chat_template": False,
                 "max_prompt_tokens": spec["prompt_tokens"], "shuffle": False},
        "reward": {"default_task": "t", "task_field": "none",
                   "tasks": {"t": {"kind": "python", "function": "_jaxrl_side:reward_fraction"}}},
        "rollout": {"engine": "embedded", "prompts_per_step": spec["prompts_per_step"],
                    "group_size": spec["group_size"], "max_new_tokens": spec["new_tokens"],
                    "temperature": spec["temperature"], "verify_push": True,
                    # bfloat16 decoding vs the learner's forward differ by more than float32's 1e-3 nats.
                    "push_tolerance": 1e-3 if spec.get("dtype", "float32") == "float32" else 0.5},
        "advantage": {"estimator": "grpo"},
        "objective": {"policy_loss": "ppo", "eps_low": spec["clip_eps"], "eps_high": spec["clip_eps"],
                      "aggregation": "seq-mean-token-mean", "kl_kind": "k3-as-loss", "kl_coef": spec["kl_coef"],
                      },
        "update": {"mini_batches": 1, "micro_batches": 1, "recompute_old_logp": recompute,
                   "pack": layout == "shared", "share_prefix": layout == "shared"},
        "optimizer": {"lr": spec["lr"], "clip_norm": spec["clip_norm"], "weight_decay": 0.0},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
        # a folder of its own, empty: the first step compiles as a first-ever run does, never loading
        # programs an earlier run stored in the default ~/.cache/jaxrl/xla
        "compile_cache_dir": os.path.join(out, "xla-cache"),
    }


def figures(metrics: dict, samples: int) -> dict:
    m = {k: float(v) for k, v in metrics.items() if k.startswith(("time/", "rollout/"))}
    staged = sum(m.get(f"time/{k}", 0.0) for k in ("rollout", "reward", "recompute", "update", "weight_push"))
    return {
        "step": m["time/step"], "generation": m["time/rollout"], "recompute": m.get("time/recompute", 0.0),
        "update": m["time/update"], "reward": m.get("time/reward", 0.0), "weight_push": m.get("time/weight_push", 0.0),
        "other": m["time/step"] - staged, "samples": samples,
        "tokens": round(m["rollout/response_length_mean"] * samples),
        "max_len": int(m["rollout/response_length_max"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--recompute", choices=("when_needed", "always"), default="when_needed")
    parser.add_argument("--layout", choices=("shared", "rows"), default="shared")
    args = parser.parse_args()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)  # our stdout; fd 1 becomes stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with open(os.path.join(args.workdir, "bench.json")) as f:
        spec = json.load(f)
    spec["workdir"] = args.workdir
    from jaxrl import distributed

    distributed.initialize()  # first, as every jaxrl command (jaxrl.distributed.host_memory: CPU scratch buffers)
    from importlib.metadata import version

    import jax
    import numpy as np

    config = make_config(spec, spec["shapes"][args.shape], os.path.join(args.workdir, f"jaxrl-{args.shape}"),
                         args.recompute, args.layout)
    trainer = build_trainer(config)
    samples = spec["prompts_per_step"] * spec["group_size"]
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.state["params"]))
    startup = time.perf_counter() - STARTED
    try:
        warmup = [figures(trainer.train_step_once(), samples) for _ in range(args.warmup)]
        info = {"stack": "jaxrl", "shape": args.shape, "params": params, "devices": str(jax.devices()),
                "recompute": args.recompute, "layout": args.layout, "warmup": warmup, "startup_s": startup,
                "versions": {p: version(p) for p in ("jaxrl", "jax", "jaxlib", "flax", "optax")}}
        protocol.write(json.dumps({"ready": True, **info}) + "\n")
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] != "run":
                break
            steps = [figures(trainer.train_step_once(), samples) for _ in range(int(words[1]))]
            protocol.write(json.dumps({"steps": steps}) + "\n")
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
