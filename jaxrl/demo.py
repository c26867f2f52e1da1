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

``jaxrl demo --task tools`` (docs/agentic.md#the-tools-demo) runs the same three phases on
multiplying two 4-digit numbers, which the model cannot compute itself, with the built-in
calculator tool (``configs/demo_tools_sft.yaml``, ``configs/demo_tools.yaml``, data under
``runs/demo_tools/``): the weak teacher's traces call the calculator with the right expression
half of the time (otherwise a digit miscopied, or ``**`` for ``*``, which the calculator
refuses), read the tool's answer and copy it into ``\\boxed{...}``; SFT trains on the model's
turns only, and GRPO plays multi-turn conversations with the calculator (config section ``env``).
It also prints the held-out tool-call success rate before and after RL and the per-turn mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import string
import sys
import time
from typing import Callable

DEMO_DIR = "runs/demo"
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
ALPHABET = "0123456789+="
WORDS = ("\\boxed{", "}")
MAX_OPERAND = 50
HELDOUT = 128
TEACHER_ACCURACY = 0.5
TEACHER_SAMPLES = 4
TARGET_RISE = 0.3

TOOLS_DEMO_DIR = "runs/demo_tools"
# The calculator's answers and error messages are text, so the tools demo reads printable ASCII;
# the fixed markup of a call and of a tool response is one token each (as \boxed{ is above).
TOOLS_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"
CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
RESPONSE_OPEN, RESPONSE_CLOSE = "\n<tool_response>\n", "\n</tool_response>\n"  # ObservationEncoder's wrapping
TOOLS_WORDS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, "\\boxed{")
TOOLS_TRAIN_PROMPTS = 16384


MIXTURE_DEMO_DIR = "runs/demo_mixture"
# The mixture's prompts: "a+b=" (math), "a+b>" (code), "word*n=" (instruction following); a code
# block's fixed markup is one token each side of the expression, as \boxed{ is for math.
CODE_OPEN, CODE_CLOSE = "```python\nprint(", ")\n```"
MIXTURE_ALPHABET = ALPHABET + ">*. " + string.ascii_lowercase
MIXTURE_WORDS = (*WORDS, CODE_OPEN, CODE_CLOSE)
MIXTURE_TASKS = ("math", "code", "instruction_following")
MAX_REPEATS = 4


def teacher_answer(total: int, rng: random.Random, accuracy: float) -> int:
    """A weak teacher's answer: right with probability ``accuracy``, else off by 1 or 10."""
    if rng.random() < accuracy:
        return total
    return abs(total + rng.choice((-10, -1, 1, 10)))


def _paths(root: str) -> dict[str, str]:
    """A demo's tokenizer folder and train/held-out JSONL files under ``root``."""
    return {"tokenizer": os.path.join(root, "tokenizer"), "train": os.path.join(root, "data", "train.jsonl"),
            "heldout": os.path.join(root, "data", "heldout.jsonl")}


def write_demo_files(root: str = DEMO_DIR, seed: int = 0, max_operand: int = MAX_OPERAND,
                     heldout: int = HELDOUT, teacher_accuracy: float = TEACHER_ACCURACY) -> dict[str, str]:
    """Writes the tokenizer folder and the train/held-out JSONL files of ``a+b=`` problems
    (``0 <= a, b < max_operand``, ``heldout`` of them held out); returns their paths.

    Each row has the prompt, the reference ``answer`` (what the reward checks) and a worked
    ``response`` from a weak teacher (``teacher_answer``) that SFT imitates."""
    from jaxrl.data import make_char_tokenizer

    paths = _paths(root)
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
                    f.write(json.dumps(addition_row(a, b, rng, teacher_accuracy)) + "\n")
    return paths


def addition_row(a: int, b: int, rng: random.Random, accuracy: float) -> dict:
    """A ``math`` row: the prompt ``a+b=``, the reference ``answer`` and the weak teacher's
    ``response`` ``\\boxed{...}`` (``teacher_answer``)."""
    worked = teacher_answer(a + b, rng, accuracy)
    return {"prompt": f"{a}+{b}=", "response": f"\\boxed{{{worked}}}", "answer": str(a + b), "task": "math"}


def teacher_expression(a: int, b: int, rng: random.Random, accuracy: float) -> str:
    """A weak teacher's calculator expression for ``a * b``: right with probability ``accuracy``;
    otherwise, as often, one digit miscopied (the call runs and returns a wrong product) or ``a**b``
    (a power far past the calculator's bound: the call fails)."""
    roll = rng.random()
    if roll < accuracy:
        return f"{a}*{b}"
    if roll > (1 + accuracy) / 2:
        return f"{a}**{b}"
    text = list(f"{a}*{b}")
    at = rng.choice([i for i, c in enumerate(text) if c.isdigit()])
    digits = "123456789" if at == 0 or text[at - 1] == "*" else "0123456789"  # operands stay 4 digits long
    text[at] = rng.choice([d for d in digits if d != text[at]])
    return "".join(text)


def teacher_trace(a: int, b: int, rng: random.Random, accuracy: float, observations) -> list[dict]:
    """The weak teacher's conversation after the prompt ``a*b=`` (SFT's multi-turn response): a
    calculator call (``teacher_expression``), the tool's answer rendered as the environment renders
    it at RL time (``observations``, a ``jaxrl.env.ObservationEncoder``), then the final answer:
    the tool's result copied, or after a failed call a rough estimate (the leading digits' product)."""
    from jaxrl.env import Calculator, call_tool, parse_tool_calls

    call = CALL_OPEN + teacher_expression(a, b, rng, accuracy) + CALL_CLOSE
    (parsed,) = parse_tool_calls(call)
    result = call_tool({"calculator": Calculator()}, parsed)
    answer = int(str(a)[0]) * int(str(b)[0]) * 10**6 if result.error else result.text
    return [{"role": "model", "text": call}, {"role": "environment", "text": observations.render([result.text])},
            {"role": "model", "text": f"\\boxed{{{answer}}}"}]


def write_tools_demo_files(root: str = TOOLS_DEMO_DIR, seed: int = 0, train_prompts: int = TOOLS_TRAIN_PROMPTS,
                           heldout: int = HELDOUT, teacher_accuracy: float = TEACHER_ACCURACY) -> dict[str, str]:
    """The tools demo's tokenizer and train/held-out JSONL files of ``a*b=`` problems (distinct
    pairs of 4-digit numbers); returns their paths. Each row has the prompt, the reference
    ``answer``, ``task: tools`` (the calculator environment and the math checker) and, for training
    rows, the weak teacher's ``response`` turns (``teacher_trace``)."""
    from jaxrl.data import make_char_tokenizer
    from jaxrl.env import ObservationEncoder

    paths = _paths(root)
    observations = ObservationEncoder(make_char_tokenizer(paths["tokenizer"], TOOLS_ALPHABET, words=TOOLS_WORDS),
                                      use_chat_template=False)
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < train_prompts + heldout:
        pairs.add((rng.randint(1000, 9999), rng.randint(1000, 9999)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    os.makedirs(os.path.dirname(paths["train"]), exist_ok=True)
    for name, chunk in (("heldout", ordered[:heldout]), ("train", ordered[heldout:])):
        with open(paths[name], "w") as f:
            for a, b in chunk:
                row = {"prompt": f"{a}*{b}=", "answer": str(a * b), "task": "tools"}
                if name == "train":
                    row["response"] = teacher_trace(a, b, rng, teacher_accuracy, observations)
                f.write(json.dumps(row) + "\n")
    return paths


def code_row(a: int, b: int, rng: random.Random, accuracy: float) -> dict:
    """A ``code`` row: the prompt ``a+b>`` asks for a program printing the sum, checked by one
    stdin/stdout case (no input, the sum on stdout); the weak teacher's program ``print(a+b')``
    copies ``b`` right with probability ``accuracy``, else off by 1 or 10 (``teacher_answer``)."""
    program = f"{CODE_OPEN}{a}+{teacher_answer(b, rng, accuracy)}{CODE_CLOSE}"
    return {"prompt": f"{a}+{b}>", "response": program, "test_cases": [{"input": "", "output": str(a + b)}],
            "task": "code"}


def instructions_row(word: str, count: int, rng: random.Random, accuracy: float) -> dict:
    """An ``instruction_following`` row: the prompt ``word*count=`` asks for ``word`` written
    ``count`` times, as three of IFEval's instructions (the keyword at least ``count`` times, fewer
    than ``count + 1`` words, ending with the word). The weak teacher follows them with probability
    ``accuracy``; else, as often, it writes the word once too many or ends with a full stop, the
    habits RL must unlearn on every prompt (held-out ones included)."""
    roll = rng.random()
    written = count + 1 if accuracy <= roll < (1 + accuracy) / 2 else count
    response = " ".join([word] * written) + ("." if roll >= (1 + accuracy) / 2 else "")
    return {"prompt": f"{word}*{count}=", "response": response, "task": "instruction_following",
            "instruction_id_list": ["keywords:frequency", "length_constraints:number_words", "startend:end_checker"],
            "kwargs": [{"keyword": word, "frequency": count, "relation": "at least"},
                       {"num_words": count + 1, "relation": "less than"}, {"end_phrase": word}]}


def write_mixture_demo_files(root: str = MIXTURE_DEMO_DIR, seed: int = 0, max_operand: int = MAX_OPERAND,
                             heldout: int = HELDOUT, teacher_accuracy: float = TEACHER_ACCURACY) -> dict[str, str]:
    """The three-task mixture's tokenizer and train/held-out JSONL files (Motif's math + code +
    instruction following, in miniature); returns their paths. Each task has ``max_operand**2``
    distinct prompts, ``heldout`` of them held out: ``addition_row``s and ``code_row``s over
    ``0 <= a, b < max_operand``, ``instructions_row``s over random 3-letter words, each word written
    1 to ``MAX_REPEATS`` times (a held-out prompt asks a count of a word that training rows ask other
    counts of: the tiny model learns words from training rows; it does not learn to copy unseen ones).
    Training prompts appear ``TEACHER_SAMPLES`` times with independent teacher responses; the
    held-out rows alternate between the tasks, so any first ``eval.max_prompts`` are balanced."""
    from jaxrl.data import make_char_tokenizer

    paths = _paths(root)
    make_char_tokenizer(paths["tokenizer"], MIXTURE_ALPHABET, words=MIXTURE_WORDS)
    rng = random.Random(seed)
    sums = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    words: set[str] = set()
    while len(words) < math.ceil(len(sums) / MAX_REPEATS):
        words.add("".join(rng.choice(string.ascii_lowercase) for _ in range(3)))
    repeats = [(word, count) for word in sorted(words) for count in range(1, MAX_REPEATS + 1)][:len(sums)]
    families = [(addition_row, list(sums)), (code_row, list(sums)), (instructions_row, repeats)]
    for _, prompts in families:
        rng.shuffle(prompts)
    os.makedirs(os.path.dirname(paths["train"]), exist_ok=True)
    with open(paths["heldout"], "w") as f:
        for i in range(heldout):
            f.writelines(json.dumps(make(*prompts[i], rng, teacher_accuracy)) + "\n" for make, prompts in families)
    with open(paths["train"], "w") as f:
        for make, prompts in families:
            f.writelines(json.dumps(make(*prompt, rng, teacher_accuracy)) + "\n"
                         for prompt in prompts[heldout:] for _ in range(TEACHER_SAMPLES))
    return paths


def _overrides(root: str, extra: list[str]) -> list[str]:
    """Points a demo config's data paths at ``root``."""
    return [f"data.tokenizer={root}/tokenizer", f"data.train_files=[{root}/data/train.jsonl]"] + extra


def run_sft(root: str = DEMO_DIR, overrides: list[str] = (), config_file: str = "demo_sft.yaml") -> dict:
    from jaxrl.config import load_config
    from jaxrl.trainer.config import TrainConfig
    from jaxrl.trainer.sft import SFTTrainer

    config = load_config(TrainConfig, os.path.join(CONFIG_DIR, config_file), _overrides(root, [
        f"output_dir={root}/sft", f"checkpoint.export_hf={root}/sft/hf", *overrides]))
    trainer = SFTTrainer(config, overwrite=True)  # the demo remakes its own run
    try:
        return trainer.run()
    finally:
        trainer.close()


def run_rl(root: str = DEMO_DIR, overrides: list[str] = (), config_file: str = "demo.yaml") -> dict:
    from jaxrl.config import load_config
    from jaxrl.trainer.config import TrainConfig
    from jaxrl.trainer.rl import RLTrainer

    config = load_config(TrainConfig, os.path.join(CONFIG_DIR, config_file), _overrides(root, [
        f"output_dir={root}/rl", f"model.hf_path={root}/sft/hf", f"data.eval_files=[{root}/data/heldout.jsonl]",
        f"checkpoint.directory={root}/rl/checkpoints", *overrides]))
    trainer = RLTrainer(config, overwrite=True)
    try:
        return trainer.run()
    finally:
        trainer.close()


def tools_report(summary: dict) -> list[str]:
    """The tools demo's own summary lines: the held-out tool-call success rate (the calculator
    calls that ran without an error, 1 - ``heldout/env/tool_error_rate``) before and after RL, and
    the per-turn mismatch of the engine's logprobs against the learner's recompute over the RL
    steps (``mismatch_turn/*``: the first model turn against the later ones, after tool output)."""
    from jaxrl.trainer.metrics import read_jsonl

    rows = read_jsonl(summary["metrics"])
    heldout = [r for r in rows if "heldout/env/tool_error_rate" in r]
    success = [1.0 - heldout[i]["heldout/env/tool_error_rate"] for i in (0, -1)]
    calls = [heldout[i]["heldout/env/tool_calls_per_conversation"] for i in (0, -1)]
    steps = [r for r in rows if "mismatch_turn/first_turn_abs_log_ratio_mean" in r]

    def mismatch(turn: str) -> str:
        mean = sum(r[f"mismatch_turn/{turn}_abs_log_ratio_mean"] for r in steps) / len(steps)
        largest = max(r[f"mismatch_turn/{turn}_abs_log_ratio_max"] for r in steps)
        return f"{turn.replace('_', ' ')} mean {mean:.2g}, max {largest:.2g}"

    turns = "; ".join(mismatch(turn) for turn in ("first_turn", "later_turns"))
    return [f"tool-call success rate (held-out calculator calls answered without an error): before RL {success[0]:.3f} "
            f"-> after RL {success[1]:.3f}  (rise {success[1] - success[0]:+.3f}; calls per conversation "
            f"{calls[0]:.2f} -> {calls[1]:.2f})",
            f"per-turn mismatch |engine - learner logprob| on the model's tokens over {len(steps)} RL steps: {turns}"]


def heldout_by_task(summary: dict, tasks=MIXTURE_TASKS) -> dict[str, tuple[float, float]]:
    """Each task's held-out reward (``heldout/<task>/reward``) at the first and the last evaluation of
    an RL run (``summary``: what ``run_rl`` returns)."""
    from jaxrl.trainer.metrics import read_jsonl

    rows = [r for r in read_jsonl(summary["metrics"]) if "heldout/reward" in r]
    return {task: (rows[0][f"heldout/{task}/reward"], rows[-1][f"heldout/{task}/reward"]) for task in tasks}


def mixture_report(summary: dict) -> list[str]:
    """The mixture demo's own summary lines: each task's held-out reward before and after RL."""
    return [f"{task}: before RL {begin:.3f} -> after RL {end:.3f}  (rise {end - begin:+.3f})"
            for task, (begin, end) in heldout_by_task(summary).items()]


@dataclasses.dataclass(frozen=True)
class DemoTask:
    """One ``jaxrl demo --task``: its default folder, data writer, SFT and RL configs (in configs/),
    what its held-out reward is, and its own summary lines (``report(summary)``)."""

    directory: str
    write_files: Callable[[str], dict]
    sft_config: str
    rl_config: str
    heldout: str
    report: Callable[[dict], list[str]] = lambda summary: []


TASKS = {
    "addition": DemoTask(DEMO_DIR, write_demo_files, "demo_sft.yaml", "demo.yaml",
                         f"math checker, {HELDOUT} held-out prompts x 2 samples, temperature 1"),
    "tools": DemoTask(TOOLS_DEMO_DIR, write_tools_demo_files, "demo_tools_sft.yaml", "demo_tools.yaml",
                      f"math checker, {HELDOUT} held-out prompts x 2 conversations with the calculator, temperature 1",
                      tools_report),
    "mixture": DemoTask(MIXTURE_DEMO_DIR, write_mixture_demo_files, "motif_mixture_cpu_sft.yaml",
                        "motif_mixture_cpu.yaml", f"{HELDOUT} held-out prompts per task x 2 samples, temperature 1, "
                        "each task's reward; per task below", mixture_report),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxrl demo", description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="addition",
                        help="addition: the main job; tools: multiplication with the calculator tool, multi-turn; "
                             "mixture: Motif's three tasks (math, code, instruction following) in one RL run")
    parser.add_argument("--dir", help=f"where the demo writes data, checkpoints, logs, plots (default {DEMO_DIR}, "
                                      f"{TOOLS_DEMO_DIR} with --task tools, {MIXTURE_DEMO_DIR} with --task mixture)")
    parser.add_argument("--sft", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides for the task's SFT config (demo_sft.yaml for addition)")
    parser.add_argument("--rl", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides for the task's RL config (demo.yaml for addition)")
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    root = args.dir or task.directory
    start = time.perf_counter()
    task.write_files(root)
    print(f"[demo] data and tokenizer in {root}; SFT warm-up ({os.path.join(CONFIG_DIR, task.sft_config)})",
          flush=True)
    run_sft(root, args.sft, task.sft_config)
    sft_done = time.perf_counter()
    print(f"[demo] SFT done in {sft_done - start:.0f} s; GRPO ({os.path.join(CONFIG_DIR, task.rl_config)})",
          flush=True)
    summary = run_rl(root, args.rl, task.rl_config)
    end = time.perf_counter()
    begin, final = summary["heldout_start"], summary["heldout_end"]
    rise = final - begin
    print()
    print(f"[demo] held-out reward ({task.heldout}):")
    print(f"[demo]   before RL {begin:.3f} -> after RL {final:.3f}  (rise {rise:+.3f}; target >= {TARGET_RISE})")
    for line in task.report(summary):
        print(f"[demo] {line}")
    if "entropy_law" in summary:
        from jaxrl.trainer.plots import law_equation

        law = summary["entropy_law"]
        beyond = ", beyond the reward's range [0, 1]: an extrapolation" if law["ceiling_beyond_range"] else ""
        print(f"[demo] entropy law {law_equation(law['a'], law['b'])}: predicted ceiling {law['ceiling']:.3f}{beyond} "
              f"(fit RMSE {law['rmse']:.3g})")
    print(f"[demo] time: SFT {sft_done - start:.0f} s, RL {end - sft_done:.0f} s, total {end - start:.0f} s")
    print(f"[demo] metrics: {summary['metrics']} (TensorBoard: tensorboard --logdir {root}/rl/tb)")
    for name, path in summary.get("plots", {}).items():
        print(f"[demo] plot {name}: {path}")
    if rise < TARGET_RISE:
        print(f"[demo] the held-out reward rose by {rise:.3f}, less than {TARGET_RISE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
