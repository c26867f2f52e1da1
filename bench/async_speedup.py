"""Synchronous vs asynchronous rollouts with a real CPU SGLang server: wall time per RL step.

    .venv/bin/python bench/async_speedup.py [--rounds 4] [--steps 4] [--json PATH]

Two trainers of the same GRPO work, each with its own SGLang server (float32, CPU, one
thread: ``OMP_NUM_THREADS=1``) started from the same random Qwen3-style checkpoint:
``rollout.max_staleness=0`` (generate, then update, then push) and ``rollout.max_staleness=1``
(the server generates batch k + 1 with the previous weights while the learner updates on batch
k). The work is sized so that generation and the learner's update take about the same time,
which is where overlapping them pays most: 4 layers x hidden 256 (the bench/vs_tunix.py
"large" shape), 8 prompts (``--prompts``) x 4 samples of exactly 32 new tokens (``<eos>``
lies outside the model's vocabulary), AdamW, the recompute and a k3 KL to the frozen
reference. On a 2-core machine the server's thread and the update's two compete for the cores
while they overlap, which bounds what overlapping can gain there.

Rounds alternate which trainer runs first; each runs ``--steps`` steps timed end to end by
the wall clock (``train_step_once`` calls back to back, so the asynchronous trainer's hidden
generation counts where it blocks). Before the other trainer runs, the asynchronous one's
in-flight batch is waited for, untimed, so the two never share the machine. The first two
steps of each trainer compile and are not timed.

Prints the median seconds per step of both, their stage medians (``time/generation`` is the
engine's time on the batch, wherever it ran), the staleness each saw, and the TARGET line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
GOAL = 1.3
STAGES = ("rollout", "generation", "reward", "recompute", "update", "rollout_drain", "weight_push")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build(spec: dict, workdir: str, model_path: str, staleness: int):
    from _jaxrl_side import build_trainer, config_dict

    from jaxrl.config import from_dict
    from jaxrl.trainer.config import TrainConfig

    data = config_dict(spec, spec["shapes"]["large"], os.path.join(workdir, f"run-s{staleness}"), "always")
    data["model"] = {"hf_path": model_path, "dtype": "float32", "param_dtype": "float32"}
    data["rollout"].update(engine="sglang", max_staleness=staleness, sglang={
        "server": {"model_path": model_path, "base_port": free_port(),
                   "log_dir": os.path.join(workdir, f"logs-{staleness}"), "startup_timeout_s": 300},
        "push": {"method": "disk", "checkpoint_dir": os.path.join(workdir, f"pushed-{staleness}")}})
    return build_trainer(from_dict(TrainConfig, data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per trainer per round")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (x 4 samples)")
    parser.add_argument("--json", help="write every figure to this JSON file")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    from vs_tunix import SHAPES, write_inputs

    from jaxrl.models import ModelConfig
    from jaxrl.rollout.sglang.testing import write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="async_speedup-") as workdir:
        spec = write_inputs(workdir, "float32")
        spec.update(workdir=workdir, prompts_per_step=args.prompts)
        shape = SHAPES["large"]
        model_path = os.path.join(workdir, "init_hf")
        write_random_checkpoint(model_path, ModelConfig(
            **{k: shape[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                     "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings")},
            max_position_embeddings=spec["prompt_tokens"] + spec["new_tokens"]), seed=0, matrix_scale=1.0)
        trainers = {s: build(spec, workdir, model_path, s) for s in (0, 1)}
        walls: dict[int, list[float]] = {0: [], 1: []}
        metrics: dict[int, list[dict]] = {0: [], 1: []}
        try:
            for trainer in trainers.values():  # compile
                for _ in range(2):
                    trainer.train_step_once()
                trainer.stage("rollout").drain()
            print(f"both trainers and servers ready in {time.perf_counter() - start:.0f} s; "
                  f"{args.rounds} rounds x {args.steps} steps each", flush=True)
            for r in range(args.rounds):
                for s in (0, 1) if r % 2 == 0 else (1, 0):
                    trainer = trainers[s]
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        metrics[s].append(trainer.train_step_once())
                        walls[s].append(time.perf_counter() - t)
                    trainer.stage("rollout").drain()  # untimed: nothing of this trainer runs during the other's turn
        finally:
            for trainer in trainers.values():
                trainer.close()
    print(f"\n{'seconds per step (median)':<28}{'sync (s=0)':>12}{'async (s=1)':>13}")
    print(f"{'wall clock, whole step':<28}{statistics.median(walls[0]):>12.4f}{statistics.median(walls[1]):>13.4f}")
    for stage in STAGES:
        values = [statistics.median([m.get(f"time/{stage}", 0.0) for m in metrics[s]]) for s in (0, 1)]
        print(f"{'  time/' + stage:<28}{values[0]:>12.4f}{values[1]:>13.4f}")
    lag = [max(m["rollout/staleness_max"] for m in metrics[s]) for s in (0, 1)]
    print(f"staleness (largest lag in updates): sync {lag[0]:.0f}, async {lag[1]:.0f}; "
          f"{len(walls[0])} timed steps each; total runtime {time.perf_counter() - start:.0f} s")
    ratio = statistics.median(walls[0]) / statistics.median(walls[1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"walls": walls, "ratio": ratio, "metrics": metrics}, f, indent=1)
    print(f"TARGET async_speedup: {ratio:.2f}x sync's time per step (goal >= {GOAL}x) "
          f"{'met' if ratio >= GOAL else 'missed'}")


if __name__ == "__main__":
    main()
