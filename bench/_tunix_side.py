"""The Tunix half of bench/vs_tunix.py: one GRPO step of Google Tunix 0.1.7, timed per step.

Runs in .venv-tunix (scripts/setup_tunix.sh), started by bench/vs_tunix.py:

    .venv-tunix/bin/python bench/_tunix_side.py --workdir DIR --shape small|large [--warmup 3]

DIR holds the shared inputs vs_tunix.py wrote: ``tokenizer/`` (a character tokenizer whose
``<eos>`` id equals the model's vocab size, so the sampler can never produce it and every
sample is exactly ``new_tokens`` long) and ``bench.json`` (shapes, prompts, step settings).

What runs, as a Tunix user runs it: ``GRPOLearner.train`` over an ``RLCluster`` on one CPU
device (actor, reference and rollout on the same 1x1 mesh, so the rollout shares the actor's
weights and no weight sync runs), ``rollout_engine="vanilla"`` (``tunix.generate.sampler.Sampler``),
a ``tunix.models.qwen3`` decoder with random float32 weights (computing in the spec's ``dtype``),
the reference a second model with the same initial weights; GRPO with ``num_generations``
samples per prompt, one iteration, one mini-batch, ``beta`` with ``kl_loss_mode="low_var_kl"``
(k3), AdamW after global-norm clipping.

Timed figures, per step (``time.perf_counter``; warm-up steps, which compile, are reported apart:
``info["warmup"]``, with ``info["startup_s"]`` from the process's start to a built learner):
- ``step``: from the moment the training-data iterator hands out step i's prompts to the moment
  the learner asks it for step i+1's: rollout, reference logprobs, reward, advantages, the
  train step, the learner's metric buffering and bookkeeping (the wait for the next command on
  stdin happens inside the iterator, outside this interval);
- ``generation``: ``RLCluster.generate`` (prompt tokenisation, the vanilla sampler's prefill and
  decode loop, the copy to host, detokenisation), the rollout GRPO runs inside the step;
- ``reference``: ``RLCluster.get_ref_per_token_logps`` until its result is ready;
- ``update``: ``RLCluster.update_actor`` (the jitted train step: policy forward, loss, backward,
  AdamW) until the updated parameters are ready;
- ``other``: step minus the three above (reward, advantages, metrics, queues, host work).
The two waits (``block_until_ready``) only move device time from a later stage into the stage
that launched it; on one CPU device nothing else could overlap with it.

Protocol: after the warm-up it prints one JSON line ``{"ready": ...}`` on stdout; then each
``run K`` line on stdin gives one JSON line with K steps' figures; ``quit`` (or EOF) ends it.
Everything else the libraries print goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import version

STARTED = time.perf_counter()  # before JAX and Tunix are imported: info["startup_s"] counts from here
PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)  # our stdout; fd 1 becomes stderr below
os.dup2(2, 1)
sys.stdout = sys.stderr


def reward_fraction(target: str):
    """The reward both sides use: the fraction of the completion's characters equal to ``target``."""

    def reward(prompts, completions, **_):
        return [c.count(target) / max(len(c), 1) for c in completions]

    return reward


def build(spec: dict, shape: dict):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from transformers import AutoTokenizer
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(spec["workdir"], "tokenizer"), local_files_only=True)
    config = qwen3.ModelConfig(
        num_layers=shape["num_layers"], vocab_size=shape["vocab_size"], embed_dim=shape["hidden_size"],
        hidden_dim=shape["intermediate_size"], num_heads=shape["num_heads"], head_dim=shape["head_dim"],
        num_kv_heads=shape["num_kv_heads"], rope_theta=int(shape["rope_theta"]), norm_eps=shape["rms_norm_eps"],
        use_tied_embedding=shape["tie_word_embeddings"], dtype=jnp.dtype(spec["dtype"]), param_dtype=np.float32,
    )
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # Built unsharded; RLCluster puts both on the mesh itself.
    actor = qwen3.Qwen3(config, rngs=nnx.Rngs(spec["seed"]))
    reference = qwen3.Qwen3(config, rngs=nnx.Rngs(spec["seed"]))  # the same initial weights
    optimizer = optax.chain(optax.clip_by_global_norm(spec["clip_norm"]),
                            optax.adamw(spec["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
    new_tokens, prompt_tokens = spec["new_tokens"], spec["prompt_tokens"]
    cluster_config = rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(
            actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=10**9, pbar_description=None),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=new_tokens, max_prompt_length=prompt_tokens,
            kv_cache_size=prompt_tokens + new_tokens, temperature=spec["temperature"], top_p=1.0, top_k=None,
            eos_tokens=[tokenizer.eos_token_id]),
    )
    cluster = rl.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=cluster_config)
    algo = grpo_learner.GRPOConfig(
        num_generations=spec["group_size"], num_iterations=1, beta=spec["kl_coef"], kl_loss_mode="low_var_kl",
        epsilon=spec["clip_eps"], loss_agg_mode="sequence-mean-token-mean")
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo,
                                       reward_fns=[reward_fraction(spec["reward_char"])])
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
    return learner, cluster, params


class Clock:
    """Per-step records; the wrappers write into the current step's record."""

    def __init__(self):
        self.current: dict = {}
        self.done: list[dict] = []

    def wrap(self, owner, name: str, key: str, wait=None, count=None):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            if wait is not None:
                wait(out)
            self.current[key] = self.current.get(key, 0.0) + time.perf_counter() - t
            if count is not None:
                count(out)
            return out

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    with open(os.path.join(args.workdir, "bench.json")) as f:
        spec = json.load(f)
    spec["workdir"] = args.workdir
    import jax
    import numpy as np
    from flax import nnx

    jax.config.update("jax_platforms", "cpu")
    learner, cluster, params = build(spec, spec["shapes"][args.shape])
    startup = time.perf_counter() - STARTED
    clock = Clock()

    def count(out):
        lengths = [len(t) for t in out.tokens]
        clock.current["tokens"] = clock.current.get("tokens", 0) + sum(lengths)
        clock.current["samples"] = clock.current.get("samples", 0) + len(lengths)
        clock.current["min_len"] = min(lengths)
        clock.current["max_len"] = max(lengths)

    clock.wrap(cluster, "generate", "generation", count=count)
    clock.wrap(cluster, "get_ref_per_token_logps", "reference", wait=jax.block_until_ready)
    clock.wrap(cluster, "update_actor", "update",
               wait=lambda _: jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param)))
    info = {"stack": "tunix", "shape": args.shape, "params": params, "devices": str(jax.devices()),
            "startup_s": startup,
            "versions": {p: version(p) for p in ("google-tunix", "jax", "jaxlib", "flax", "optax")}}
    prompts, per_step = spec["prompts"], spec["prompts_per_step"]

    def batches():
        remaining, served, handed_out = args.warmup, 0, None
        while True:
            asked = time.perf_counter()
            if handed_out is not None:
                clock.current["step"] = asked - handed_out
                clock.current["other"] = clock.current["step"] - sum(
                    clock.current.get(k, 0.0) for k in ("generation", "reference", "update"))
                clock.done.append(clock.current)
            if remaining == 0:
                first = "warmup" not in info
                if first:
                    info["warmup"] = clock.done
                    PROTOCOL.write(json.dumps({"ready": True, **info}) + "\n")
                else:
                    PROTOCOL.write(json.dumps({"steps": clock.done}) + "\n")
                clock.done = []
                line = sys.stdin.readline().split()
                if not line or line[0] != "run":
                    return
                remaining = int(line[1])
            remaining -= 1
            batch = [prompts[(served * per_step + i) % len(prompts)] for i in range(per_step)]
            served += 1
            clock.current = {}
            handed_out = time.perf_counter()
            yield {"prompts": np.array(batch)}  # one leaf: GRPO repeats it G times

    learner.train(batches())


if __name__ == "__main__":
    main()
