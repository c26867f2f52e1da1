"""Motif's three-task mixture on a CPU (``jaxrl demo --task mixture``, configs/motif_mixture_cpu*.yaml),
shortened: SFT warm-up on math, code and instruction-following rows, then GRPO on batches a third
each task, every task scored by its own reward kind (the math checker, the program run against its
stdin/stdout case in the sandbox, IFEval's instruction checks), and every task's reward logged on
its own (``reward/<task>/mean`` per step, ``heldout/<task>/reward`` per evaluation).

Each task's reward must rise by more than chance moves it, the chance scale measured in the same
run from the reward before learning. The rise is read on the arcsine scale ``2 asin(sqrt(p))``
(Anscombe 1948; Cohen's h), where a mean of n draws of a 0/1 reward has standard error
``1 / sqrt(n)`` whatever p: near 1 the raw scale's ``sqrt(p (1 - p) / n)`` band reaches past the
ceiling. Four SFT + RL seeds on an AVX2 machine (jax 0.10.2, the suite's XLA flags) started
instruction following's training reward at 0.769-0.861 and ended it at 0.952-0.970: 3.7-5.0
standard errors on the arcsine scale, 2.8-3.9 on the raw one, where two of the four missed 3
(0.861 -> 0.970: three raw standard errors above 0.861 is 0.977, 0.023 below the ceiling). The
lowest training rise of any task and seed was math's 3.4 (raw 3.3).

- the training reward, what RL optimises: the mean of the last ``WINDOW`` steps' ``reward/<task>/mean``
  over the first ``WINDOW`` steps' by ``TRAIN_RISE`` standard errors, counting each prompt as one draw
  (its group's samples are not independent);
- the held-out reward, on prompts never trained on, after RL over before RL by ``HELDOUT_RISE``
  standard errors of the before-RL estimate (prompts x samples draws, the same prompts both times).
  The held-out bar is lower. Math's held-out rise is not met: 84 addition facts teach a 2-layer model
  little arithmetic it can carry to unseen sums. It rose 0.047-0.094 (1.9-4.9 standard errors) on
  four variants of this run and fell on others (0.234 -> 0.191, 0.188 and 0.211 after 40, 60 and 80
  RL steps under the suite's XLA flags, while math's training reward rose to 0.75-0.85), so the
  test reports it as an expected failure (xfail) with its figures; code's and instruction
  following's held-out rises (0.23-0.50) are asserted.

Between the phases the SFT model goes through ``jaxrl filter`` with the RL config's per-task bands
(Motif's math (0, 0.8], instruction following (0, 0.4]) on the held-out rows: every task is scored
by its own reward and judged by its own band.

A reward that ignores its task, a router that scores one task with another's reward, a flipped or
detached gradient all leave some task flat or falling.
"""

import json
import math
import os
import time

import numpy as np
import pytest

from jaxrl.cli import main
from jaxrl.demo import CONFIG_DIR, MIXTURE_TASKS, heldout_by_task, mixture_report, run_rl, run_sft, \
    write_mixture_demo_files
from jaxrl.trainer.metrics import read_jsonl

SFT_STEPS = 600
RL_STEPS = 40
PROMPTS_PER_STEP = 24
HELDOUT_PER_TASK = 16
EVAL_SAMPLES = 16
WINDOW = 10
TRAIN_RISE = 3.0
HELDOUT_RISE = 1.0


def rise_in_standard_errors(before: float, after: float, draws: int) -> float:
    """How far ``after`` lies above ``before``, a mean of ``draws`` 0/1 rewards, in standard errors
    of ``before`` on the arcsine scale: ``(2 asin(sqrt(after)) - 2 asin(sqrt(before))) sqrt(draws)``.

    >>> round(rise_in_standard_errors(0.5, 0.6, 100), 2)  # the raw scale's (0.6 - 0.5) / sqrt(0.25 / 100) is 2.0
    2.01
    """
    return (2 * math.asin(math.sqrt(after)) - 2 * math.asin(math.sqrt(before))) * math.sqrt(draws)


@pytest.mark.slow
def test_each_task_of_the_mixture_learns_and_is_reported(tmp_path):
    root = str(tmp_path / "mixture")
    write_mixture_demo_files(root, max_operand=10, heldout=HELDOUT_PER_TASK)
    quiet = ["logging.progress=false", "logging.tensorboard=false", "logging.plots=false"]
    start = time.perf_counter()
    run_sft(root, [f"sft.stages=[{{steps: {SFT_STEPS}, max_length: 32}}]", *quiet], "motif_mixture_cpu_sft.yaml")
    sft_done = time.perf_counter()
    _filter_with_the_per_task_bands(root, str(tmp_path / "kept.jsonl"))
    summary = run_rl(root, [f"steps={RL_STEPS}", f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
                            f"eval.samples={EVAL_SAMPLES}", f"eval.max_prompts={3 * HELDOUT_PER_TASK}",
                            "eval.every=0", "checkpoint.directory=", *quiet], "motif_mixture_cpu.yaml")
    print(f"SFT {sft_done - start:.0f} s, RL {time.perf_counter() - sft_done:.0f} s")
    steps = [r for r in read_jsonl(summary["metrics"]) if "reward/mean" in r]
    assert len(steps) == RL_STEPS
    heldout = heldout_by_task(summary)
    figures = {}
    for task in MIXTURE_TASKS:
        shares = np.array([r[f"reward/{task}/share"] for r in steps])
        rewards = np.array([r[f"reward/{task}/mean"] for r in steps])
        early, late = rewards[:WINDOW].mean(), rewards[-WINDOW:].mean()
        train_rise = rise_in_standard_errors(early, late, round(shares[:WINDOW].sum() * PROMPTS_PER_STEP))
        before, after = heldout[task]
        heldout_rise = rise_in_standard_errors(before, after, HELDOUT_PER_TASK * EVAL_SAMPLES)
        figures[task] = shares.mean(), before, train_rise, heldout_rise
        print(f"{task}: training reward {early:.3f} -> {late:.3f} ({train_rise:.1f} standard errors); held-out "
              f"{before:.3f} -> {after:.3f} ({heldout_rise:.1f} standard errors)")
    for task, (share, before, train_rise, heldout_rise) in figures.items():
        assert abs(share - 1 / 3) < 0.1, (task, share)  # data.mixture's equal weights
        assert 0.05 < before < 0.9, f"{task}: SFT should teach the format and leave room to learn"
        assert train_rise > TRAIN_RISE, (task, train_rise)
        if task != "math":
            assert heldout_rise > HELDOUT_RISE, (task, heldout_rise)
    assert [line.split(":")[0] for line in mixture_report(summary)] == list(MIXTURE_TASKS)  # jaxrl demo's lines
    before, after = heldout["math"]
    if not figures["math"][3] > HELDOUT_RISE:
        pytest.xfail(f"math's held-out reward does not rise: {before:.3f} -> {after:.3f} ({figures['math'][3]:.1f} "
                     f"standard errors); the 2-layer model learns the training sums, not addition that carries to "
                     f"unseen ones (docs/training.md#the-motif-three-task-mixture)")


def _filter_with_the_per_task_bands(root: str, output: str) -> None:
    """``jaxrl filter configs/motif_mixture_cpu.yaml`` with the SFT model on the held-out rows: each
    task's rows are kept exactly when their pass rate lies in that task's band of the config."""
    heldout = f"{root}/data/heldout.jsonl"
    assert main(["filter", os.path.join(CONFIG_DIR, "motif_mixture_cpu.yaml"), f"data.tokenizer={root}/tokenizer",
                 f"model.hf_path={root}/sft/hf", f"filter.input_files=[{heldout}]", f"filter.output={output}",
                 "logging.progress=false"]) == 0
    summary = json.load(open(output + ".summary.json"))
    bands = {"math": (0.0, 0.8), "code": (0.0, 0.8), "instruction_following": (0.0, 0.4)}
    assert {task: (t["band"]["low"], t["band"]["high"]) for task, t in summary["tasks"].items()} == bands
    assert all(summary["tasks"][task]["in"] == HELDOUT_PER_TASK for task in MIXTURE_TASKS)
    kept = [json.loads(line) for line in open(output)]
    assert kept and all(bands[r["task"]][0] < r["pass_rate"] <= bands[r["task"]][1] for r in kept)
    print("filter kept per task:", {task: t["kept"] for task, t in summary["tasks"].items()})
