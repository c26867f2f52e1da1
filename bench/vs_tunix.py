"""jaxrl vs Google Tunix 0.1.7: one GRPO step, side by side, on the same work (CPU, float32).

    .venv/bin/python bench/vs_tunix.py [--quick] [--json PATH] [--rounds N] [--steps K] [--recompute always]
        [--layout rows] [--shapes small,large] [--dtype float32|bfloat16] [--device cpu|gpu] [--python PATH]

It runs scripts/setup_tunix.sh first (a no-op when .venv-tunix is current), writes the shared
inputs to a temporary folder (a character tokenizer, the prompts, the settings), then starts one
persistent process per stack and shape: bench/_jaxrl_side.py in .venv (jaxrl's RLTrainer, its
embedded sampler) and bench/_tunix_side.py in .venv-tunix (Tunix's GRPOLearner over an RLCluster,
its vanilla sampler ``tunix.generate.sampler.Sampler``). Each warms up (``--warmup`` steps,
which compile) and then waits; each round asks, per shape, jaxrl for K steps then Tunix for K
steps (the order alternates between rounds), so both see the same machine noise. Each side's
docstring says exactly what its figures cover.

The work, identical on both sides: a Qwen3-style decoder (q/k RMSNorm, RoPE theta 1e6, SwiGLU,
untied embeddings) with random float32 weights, "small" = 2 layers x hidden 128 and "large" =
4 layers x hidden 256 (4 heads, 2 kv heads, head_dim 32 / 64, intermediate 4 x hidden, vocab
512; the parameter counts are printed from both sides); per step 4 prompts of 16 tokens x 4
samples of exactly 32 new tokens (the tokenizer's ``<eos>`` id is 512, outside the model's
vocab, so no sample can stop early; the generated token counts of every step are checked),
temperature 1; GRPO advantages, PPO clip 0.2, k3 KL to the frozen initial weights with
coefficient 0.04, sequence-mean-token-mean aggregation, one mini-batch, one epoch; AdamW (lr
1e-5) after global-norm clipping at 1; the reward: the fraction of the response's characters
equal to one fixed character. One CPU device (``JAX_PLATFORMS=cpu``).

On an accelerator (bench/gpu_checks.sh): ``--device gpu`` runs both sides on the first CUDA device
(each process's share of its memory is capped so that all fit), ``--dtype bfloat16`` computes in
bfloat16 over float32 parameters on both sides (jaxrl's ``rollout.push_tolerance`` raised to
bfloat16's residual), ``--shapes 0.6b`` is Qwen3-0.6B's blocks (28 layers x hidden 1024, 16 heads
of 128, 8 kv heads, intermediate 3072; 0.44B parameters with the 512-id vocabulary), and
``--python`` names one interpreter that holds both stacks (it skips scripts/setup_tunix.sh).

Prints a table per shape (medians in seconds, Tunix/jaxrl ratios: > 1 means jaxrl is faster; then
the cold start: each process's start-up to a built trainer and its first step, compiles included,
jaxrl's into an empty compilation cache),
the versions on each side, the total runtime, and ends with the four TARGET lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512
COMMON = {"vocab_size": VOCAB, "num_heads": 4, "num_kv_heads": 2, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False}
SHAPES = {
    "small": {**COMMON, "num_layers": 2, "hidden_size": 128, "head_dim": 32, "intermediate_size": 512},
    "large": {**COMMON, "num_layers": 4, "hidden_size": 256, "head_dim": 64, "intermediate_size": 1024},
    "0.6b": {**COMMON, "num_layers": 28, "hidden_size": 1024, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
             "intermediate_size": 3072},
}
PLATFORMS = {"cpu": "cpu", "gpu": "cuda"}  # --device -> JAX_PLATFORMS
SETTINGS = {"prompts_per_step": 4, "group_size": 4, "prompt_tokens": 16, "new_tokens": 32, "seed": 0,
            "lr": 1e-5, "clip_norm": 1.0, "kl_coef": 0.04, "clip_eps": 0.2, "temperature": 1.0}
GOALS = {"whole_step": ("step", 1.5), "generation": ("generation", 1.2)}
READ_TIMEOUT_S = 900


def write_inputs(workdir: str, dtype: str) -> dict:
    """The shared tokenizer (``<pad>`` 0, ``<unk>`` 1, 510 characters, ``<eos>`` = VOCAB), prompts, settings."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(0x4E00 + i) for i in range(VOCAB - 2)]
    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}, "<eos>": VOCAB}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<unk>", "<eos>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")
    fast.save_pretrained(os.path.join(workdir, "tokenizer"))
    rng = random.Random(0)
    prompts = ["".join(rng.choice(chars[1:]) for _ in range(SETTINGS["prompt_tokens"])) for _ in range(64)]
    if any(len(fast.encode(p)) != SETTINGS["prompt_tokens"] for p in prompts):
        raise RuntimeError(f"the shared tokenizer does not make {SETTINGS['prompt_tokens']}-token prompts")
    spec = {**SETTINGS, "dtype": dtype, "shapes": SHAPES, "prompts": prompts, "reward_char": chars[0]}
    with open(os.path.join(workdir, "prompts.jsonl"), "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p, "target": spec["reward_char"]}) + "\n")
    with open(os.path.join(workdir, "bench.json"), "w") as f:
        json.dump(spec, f)
    return spec


class Side:
    """One persistent benchmark process (a stack and a shape)."""

    def __init__(self, stack: str, shape: str, workdir: str, warmup: int, recompute: str, layout: str, *,
                 python: str | None, device: str, memory_share: float):
        self.stack, self.shape = stack, shape
        python = python or os.path.join(ROOT, ".venv" if stack == "jaxrl" else ".venv-tunix", "bin", "python")
        cmd = [python, os.path.join(ROOT, "bench", f"_{stack}_side.py"), "--workdir", workdir, "--shape", shape,
               "--warmup", str(warmup)] + (["--recompute", recompute, "--layout", layout] if stack == "jaxrl" else [])
        self.log_path = os.path.join(workdir, f"{stack}-{shape}.log")
        self.log = open(self.log_path, "w")
        env = {**os.environ, "JAX_PLATFORMS": PLATFORMS[device], "TF_CPP_MIN_LOG_LEVEL": "2",
               "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{memory_share:.2f}"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=ROOT, env=env)
        self.info: dict = {}
        self.steps: list[dict] = []

    def read(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], READ_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            with open(self.log_path) as f:
                tail = f.read()[-4000:]
            sys.exit(f"{self.stack}/{self.shape} gave no answer (exit {self.proc.poll()}); its log "
                     f"{self.log_path} ends:\n{tail}")
        return json.loads(line)

    def run(self, k: int) -> None:
        self.proc.stdin.write(f"run {k}\n")
        self.proc.stdin.flush()
        self.steps += self.read()["steps"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def median(steps: list[dict], key: str) -> float:
    values = [s[key] for s in steps if key in s]
    return statistics.median(values) if values else float("nan")


def report(shape: str, jaxrl: Side, tunix: Side, spec: dict) -> dict:
    s = SHAPES[shape]
    print(f"\n== {shape}: {s['num_layers']} layers, hidden {s['hidden_size']}, {s['num_heads']} heads "
          f"({s['num_kv_heads']} kv) x {s['head_dim']}, intermediate {s['intermediate_size']}, vocab {s['vocab_size']};"
          f" params jaxrl {jaxrl.info['params']:,} / tunix {tunix.info['params']:,}; {spec['dtype']} compute")
    print(f"   {len(jaxrl.steps)} / {len(tunix.steps)} timed steps (after {len(jaxrl.info['warmup'])} / "
          f"{len(tunix.info['warmup'])} warm-up steps); median seconds per step")
    rows = [("whole step", "step", "step"), ("generation (rollout)", "generation", "generation"),
            ("update (train step)", "update", "update"),
            ("recompute | reference logp", "recompute", "reference"), ("host/other", "other", "other")]
    print(f"   {'figure':<28}{'jaxrl':>10}{'tunix':>10}{'tunix/jaxrl':>13}")
    figures = {}
    for label, jkey, tkey in rows:
        j, t = median(jaxrl.steps, jkey), median(tunix.steps, tkey)
        figures[jkey] = {"jaxrl": j, "tunix": t, "ratio": t / j}
        print(f"   {label:<28}{j:>10.4f}{t:>10.4f}{t / j:>12.2f}x")
    # The cold start: every process starts at once (on 2 cores with one shape, one core each).
    cold = [("start-up (imports, model)", jaxrl.info["startup_s"], tunix.info["startup_s"]),
            ("first step (compiles)", jaxrl.info["warmup"][0]["step"], tunix.info["warmup"][0]["step"])]
    cold.append(("start to end of step 1", cold[0][1] + cold[1][1], cold[0][2] + cold[1][2]))
    for label, j, t in cold:
        print(f"   {label:<28}{j:>10.2f}{t:>10.2f}{t / j:>12.2f}x")
    figures["cold_start"] = {"jaxrl": cold[-1][1], "tunix": cold[-1][2], "ratio": cold[-1][2] / cold[-1][1]}
    skipped = jaxrl.info["recompute"] == "when_needed"
    jaxrl_recompute = "ref_logp only (update.recompute_old_logp=when_needed)" if skipped else "old_logp + ref_logp"
    print(f"   recompute: jaxrl {jaxrl_recompute},"
          " tunix ref logp only (1-iteration GRPO takes old logp from the loss's own forward);")
    print(f"   host/other: jaxrl's leaves out time/reward ({median(jaxrl.steps, 'reward'):.4f}) and time/weight_push "
          f"({median(jaxrl.steps, 'weight_push'):.4f}), tunix's holds its reward, advantages, metrics and queues")
    expected = spec["prompts_per_step"] * spec["group_size"] * spec["new_tokens"]
    counts = {name: sorted({(x["samples"], x["tokens"], x["max_len"]) for x in side.info["warmup"] + side.steps})
              for name, side in (("jaxrl", jaxrl), ("tunix", tunix))}
    equal = all(c == [(spec["prompts_per_step"] * spec["group_size"], expected, spec["new_tokens"])]
                for c in counts.values())
    print(f"   generated tokens per step (samples, tokens, longest): jaxrl {counts['jaxrl']}, tunix {counts['tunix']}"
          f" -> {'equal work: every step ' + str(expected) + ' tokens' if equal else 'WORK DIFFERS'}")
    return {"figures": figures, "token_counts": counts, "equal_work": equal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (3 x 3 per side and shape)")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved runs [8; quick 3]")
    parser.add_argument("--steps", type=int, help="steps per side per round [5; quick 3]")
    parser.add_argument("--warmup", type=int, help="untimed steps per process before the rounds [3; quick 2]")
    parser.add_argument("--shapes", default="small,large")
    parser.add_argument("--recompute", choices=("when_needed", "always"), default="when_needed",
                        help="jaxrl's update.recompute_old_logp: when_needed skips the redundant old_logp forward, "
                             "as Tunix's 1-iteration GRPO does; always keeps it")
    parser.add_argument("--layout", choices=("shared", "rows"), default="shared",
                        help="jaxrl's learner rows: shared = update.pack + update.share_prefix (each group's prompt "
                             "laid out once); rows = one sample per row, as Tunix")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both sides' compute dtype (parameters stay float32)")
    parser.add_argument("--device", choices=sorted(PLATFORMS), default="cpu")
    parser.add_argument("--python", help="one interpreter with both stacks installed, instead of .venv and .venv-tunix")
    parser.add_argument("--json", help="write every figure to this JSON file")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 8)
    k = args.steps or (3 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    shapes = args.shapes.split(",")
    start = time.perf_counter()
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    if args.python is None:
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_tunix.sh")], check=True)
    with tempfile.TemporaryDirectory(prefix="vs_tunix-") as workdir:
        spec = write_inputs(workdir, args.dtype)
        # All processes live at once: on a GPU each gets an equal share of its memory (JAX takes 75% by default).
        share = 0.9 / (2 * len(shapes))
        sides = {(stack, shape): Side(stack, shape, workdir, warmup, args.recompute, args.layout, python=args.python,
                                      device=args.device, memory_share=share)
                 for shape in shapes for stack in ("jaxrl", "tunix")}
        try:
            for side in sides.values():
                side.info = side.read()
            print(f"all {len(sides)} processes warmed up in {time.perf_counter() - start:.0f} s; "
                  f"{rounds} rounds x {k} steps per side and shape")
            for r in range(rounds):
                for shape in shapes:
                    for stack in ("jaxrl", "tunix") if r % 2 == 0 else ("tunix", "jaxrl"):
                        sides[stack, shape].run(k)
        finally:
            for side in sides.values():
                side.close()
    results = {shape: report(shape, sides["jaxrl", shape], sides["tunix", shape], spec) for shape in shapes}
    print()
    for stack in ("jaxrl", "tunix"):
        info = sides[stack, shapes[0]].info
        print(f"versions {stack}: " + ", ".join(f"{p} {v}" for p, v in info["versions"].items())
              + f"; devices {info['devices']}"
              + (f"; update.recompute_old_logp={args.recompute}, --layout {args.layout}" if stack == "jaxrl" else ""))
    total = time.perf_counter() - start
    print(f"total runtime {total:.0f} s")
    targets = []
    for name, (key, goal) in GOALS.items():
        for shape in shapes:
            ratio = results[shape]["figures"][key]["ratio"]
            targets.append({"target": f"{name}_{shape}", "ratio": ratio, "goal": goal, "met": ratio >= goal})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": spec, "recompute_old_logp": args.recompute, "layout": args.layout,
                       "rounds": rounds, "steps_per_round": k,
                       "total_runtime_s": total, "results": results, "targets": targets,
                       "sides": {f"{stack}/{shape}": {"info": s.info, "steps": s.steps}
                                 for (stack, shape), s in sides.items()}}, f, indent=1)
    for t in targets:
        print(f"TARGET {t['target']}: {t['ratio']:.2f}x faster than Tunix (goal >= {t['goal']}x) "
              f"{'met' if t['met'] else 'missed'}")


if __name__ == "__main__":
    main()
