"""The main job on a CPU: a small model learns two-number addition with RL.

1. Writes a character tokenizer and synthetic data under ``runs/demo/``: prompts
   ``"a+b="`` with ``0 <= a, b < 50``, the reference answer, and worked answers
   ``"\\boxed{...}"`` from a weak teacher that is right half of the time (otherwise off
   by 1 or 10), four per prompt; 128 prompts are held out (never trained on).
2. SFT warm-up (``configs/demo_sft.yaml``): a 2-layer, 64-wide Qwen3-style decoder,
   trained from scratch to imitate the teacher, so its sampled answers are right about
   half of the time; exported as a Hugging Face folder.
3. GRPO (``configs/demo.yaml``) from that folder with the embedded sampler and the
   math final-answer checker (``jaxrl.reward.MathAnswerReward``, the same code as for
   real datasets), PPO clip-higher, token-mean aggregation: the verifiable reward
   teaches the model to stop making the teacher's mistakes.
Each run of the demo starts afresh: it overwrites its own earlier run under ``--dir``.
The held-out reward (mean over 128 held-out prompts x 2 samples at temperature 1,
scored by the same reward code) is measured before the first RL step and after the
last; the rise, the timings and the plots' paths are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

DEMO_DIR = "runs/demo"
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
ALPHABET = "0123456789+="
WORDS = ("\\boxed{", "}")
MAX_OPERAND = 50
HELDOUT = 128
TEACHER_ACCURACY = 0.5
TEACHER_SAMPLES = 4
TARGET_RISE = 0.3


def teacher_answer(total: int, rng: random.Random, accuracy: float) -> int:
    """A weak teacher's answer: right with probability ``accuracy``, else off by 1 or 10."""
    if rng.random() < accuracy:
        return total
    return abs(total + rng.choice((-10, -1, 1, 10)))


def write_demo_files(root: str = DEMO_DIR, seed: int = 0, max_operand: int = MAX_OPERAND,
                     heldout: int = HELDOUT, teacher_accuracy: float = TEACHER_ACCURACY) -> dict[str, str]:
    """Writes the tokenizer folder and the train/held-out JSONL files of ``a+b=`` problems
    (``0 <= a, b < max_operand``, ``heldout`` of them held out); returns their paths.

    Each row has the prompt, the reference ``answer`` (what the reward checks) and a worked
    ``response`` from a weak teacher (``teacher_answer``) that SFT imitates."""
    from jaxrl.data import make_char_tokenizer

    paths = {"tokenizer": os.path.join(root, "tokenizer"), "train": os.path.join(root, "data", "train.jsonl"),
             "heldout": os.path.join(root, "data", "heldout.jsonl")}
    make_char_tokenizer(paths["tokenizer"], ALPHABET, words=WORDS)
    pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    os.makedirs(os.path.dirname(paths["train"]), exist_ok=True)
    # Training prompts appear TEACHER_SAMPLES times, each with an independent teacher answer, so
    # SFT sees the teacher's distribution rather than one fixed (possibly wrong) answer per prompt.
    for name, chunk, copies in (("heldout", pairs[:heldout], 1), ("train", pairs[heldout:], TEACHER_SAMPLES)):
        with open(paths[name], "w") as f:
            for a, b in chunk:
                for _ in range(copies):
                    worked = teacher_answer(a + b, rng, teacher_accuracy)
                    row = {"prompt": f"{a}+{b}=", "response": f"\\boxed{{{worked}}}", "answer": str(a + b),
                           "task": "math"}
                    f.write(json.dumps(row) + "\n")
    return paths


def _overrides(root: str, extra: list[str]) -> list[str]:
    """Points a demo config's runs/demo paths at ``root``."""
    if root == DEMO_DIR:
        return extra
    return [f"data.tokenizer={root}/tokenizer", f"data.train_files=[{root}/data/train.jsonl]"] + extra


def run_sft(root: str = DEMO_DIR, overrides: list[str] = ()) -> dict:
    from jaxrl.config import load_config
    from jaxrl.trainer.config import TrainConfig
    from jaxrl.trainer.sft import SFTTrainer

    config = load_config(TrainConfig, os.path.join(CONFIG_DIR, "demo_sft.yaml"), _overrides(root, [
        f"output_dir={root}/sft", f"checkpoint.export_hf={root}/sft/hf", *overrides]))
    trainer = SFTTrainer(config, overwrite=True)  # the demo remakes its own run
    try:
        return trainer.run()
    finally:
        trainer.close()


def run_rl(root: str = DEMO_DIR, overrides: list[str] = ()) -> dict:
    from jaxrl.config import load_config
    from jaxrl.trainer.config import TrainConfig
    from jaxrl.trainer.rl import RLTrainer

    config = load_config(TrainConfig, os.path.join(CONFIG_DIR, "demo.yaml"), _overrides(root, [
        f"output_dir={root}/rl", f"model.hf_path={root}/sft/hf", f"data.eval_files=[{root}/data/heldout.jsonl]",
        f"checkpoint.directory={root}/rl/checkpoints", *overrides]))
    trainer = RLTrainer(config, overwrite=True)
    try:
        return trainer.run()
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxrl demo", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=DEMO_DIR, help="where the demo writes data, checkpoints, logs, plots")
    parser.add_argument("--sft", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for demo_sft.yaml")
    parser.add_argument("--rl", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for demo.yaml")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    write_demo_files(args.dir)
    print(f"[demo] data and tokenizer in {args.dir}; SFT warm-up ({os.path.join(CONFIG_DIR, 'demo_sft.yaml')})",
          flush=True)
    run_sft(args.dir, args.sft)
    sft_done = time.perf_counter()
    print(f"[demo] SFT done in {sft_done - start:.0f} s; GRPO ({os.path.join(CONFIG_DIR, 'demo.yaml')})", flush=True)
    summary = run_rl(args.dir, args.rl)
    end = time.perf_counter()
    begin, final = summary["heldout_start"], summary["heldout_end"]
    rise = final - begin
    print()
    print(f"[demo] held-out reward (math checker, {HELDOUT} held-out prompts x 2 samples, temperature 1):")
    print(f"[demo]   before RL {begin:.3f} -> after RL {final:.3f}  (rise {rise:+.3f}; target >= {TARGET_RISE})")
    if "entropy_law" in summary:
        law = summary["entropy_law"]
        print(f"[demo] entropy law R = -{law['a']:.3g} exp(H) + {law['b']:.3g}: predicted ceiling {law['ceiling']:.3f} "
              f"(fit RMSE {law['rmse']:.3g})")
    print(f"[demo] time: SFT {sft_done - start:.0f} s, RL {end - sft_done:.0f} s, total {end - start:.0f} s")
    print(f"[demo] metrics: {summary['metrics']} (TensorBoard: tensorboard --logdir {args.dir}/rl/tb)")
    for name, path in summary.get("plots", {}).items():
        print(f"[demo] plot {name}: {path}")
    if rise < TARGET_RISE:
        print(f"[demo] the held-out reward rose by {rise:.3f}, less than {TARGET_RISE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
