"""The seeds' batch recipes through the trainer: dynamic sampling (DAPO: only prompt groups whose
rewards vary, more prompts drawn to fill the batch), trajectory reuse (``update.epochs``) and
task mixtures (``data.mixture``, per SFT stage too)."""

import json

import jax
import numpy as np
import pytest

from jaxrl.trainer.rl import RLTrainer

import test_loop
from test_loop import _params, make_config, spy

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests

PARITY_REWARD = {"default_task": "t", "task_field": "none",
                 "tasks": {"t": {"kind": "python", "function": "toy_rewards:parity_reward"}}}


def run_recording(config):
    """Runs the trainer; returns every draw's (prompts, scores [P, G]) in draw order per step and
    each step's trained (prompts, scores) and metrics."""
    trainer = RLTrainer(config)
    draws = []
    reward, packing = trainer.stage("reward"), spy(trainer, "pack")
    score = reward.score

    def recording_score(record):
        scored = score(record)
        draws.append((trainer.step + 1, [e.prompt for e in record.examples],
                      scored.scored.scores.reshape(len(record.examples), -1)))
        return scored

    reward.score = recording_score
    try:
        rows = [trainer.train_step_once() for _ in range(config.steps)]
    finally:
        trainer.close()
    trained = [([e.prompt for e in record.examples], record.scored.scores.reshape(len(record.examples), -1))
               for record, _, _ in packing.calls]
    return draws, trained, rows


@pytest.mark.parametrize("max_extra_draws", [4, 0])
def test_dynamic_sampling_keeps_only_groups_with_reward_variance_and_fills_the_batch(files, tmp_path,
                                                                                      max_extra_draws):
    config = make_config(files, tmp_path, steps=2, reward=PARITY_REWARD,
                         rollout={"dynamic_sampling": True, "max_extra_draws": max_extra_draws})
    draws, trained, rows = run_recording(config)
    prompts_per_step, group_size = config.rollout.prompts_per_step, config.rollout.group_size
    for step, ((prompts, scores), metrics) in enumerate(zip(trained, rows, strict=True), start=1):
        groups = [(p, s) for index, ps, ss in draws if index == step for p, s in zip(ps, ss, strict=True)]
        signal = [(p, s) for p, s in groups if np.ptp(s) > 0]
        zero = [(p, s) for p, s in groups if np.ptp(s) == 0]
        short = max(prompts_per_step - len(signal), 0)
        # The batch: the first groups with signal in draw order, then (when the cap stopped the
        # draws first) the earliest zero-variance ones; always full.
        want = signal[:prompts_per_step] + zero[:short]
        assert prompts == [p for p, _ in want] and scores.shape == (prompts_per_step, group_size)
        np.testing.assert_array_equal(scores, np.stack([s for _, s in want]))
        assert len(groups) == prompts_per_step * (1 + metrics["rollout/dynamic_sampling_draws"])
        assert metrics["rollout/dynamic_sampling_draws"] <= max_extra_draws
        assert metrics["rollout/dynamic_sampling_short"] == short
        assert metrics["rollout/dynamic_sampling_dropped"] == metrics["rollout/dynamic_sampling_dropped/t"] \
            == len(zero) - short
    # The demo data has even and odd answers: the recipe had work to do.
    assert sum(r["rollout/dynamic_sampling_dropped"] + r["rollout/dynamic_sampling_short"] for r in rows) > 0
    if max_extra_draws:
        assert all(np.ptp(scores, axis=1).min() > 0 for _, scores in trained)


def test_epochs_run_the_mini_batches_again_over_the_same_batch(files, tmp_path):
    """update.epochs=2 == the one-pass update run twice on each step's batch (a hand-rolled second
    pass), and differs from one pass."""
    def config(name, epochs):
        return make_config(files, tmp_path / name, steps=2, update={"mini_batches": 2, "epochs": epochs})

    params = {}
    for name, epochs in (("one", 1), ("two", 2)):
        trainer = RLTrainer(config(name, epochs))
        try:
            trainer.run()
            params[name] = _params(trainer)
        finally:
            trainer.close()
    trainer = RLTrainer(config("hand", 1))
    update = trainer.stage("update")
    one_pass = update.update
    update.update = lambda batch, step, skip: (one_pass(batch, step, skip), one_pass(batch, step, skip))[1]
    try:
        trainer.run()
        params["hand"] = _params(trainer)
    finally:
        trainer.close()
    for a, b in zip(params["two"], params["hand"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert max(np.abs(a - b).max() for a, b in zip(params["one"], params["two"], strict=True)) > 1e-4
    assert int(jax.device_get(trainer.state["step"])) == 2 * 2 * 2


@pytest.fixture(scope="module")
def two_task_files(files, tmp_path_factory):
    """The demo's training rows split into task "a" (a quarter of them) and "b"."""
    rows = [json.loads(line) for line in open(files["train"])]
    path = tmp_path_factory.mktemp("mix") / "train.jsonl"
    path.write_text("".join(json.dumps({**row, "task": "a" if i % 4 == 0 else "b"}) + "\n"
                            for i, row in enumerate(rows)))
    return {**files, "train": str(path)}


def test_data_mixture_sets_each_tasks_share_of_the_rl_batch(two_task_files, tmp_path):
    """Weights a:b = 3:1 over rows that are 1:3: the batches' share of task a (logged per step as
    reward/a/share) is the weights' 0.75 within 3 standard errors, not the rows' 0.25."""
    digit = {"kind": "python", "function": "toy_rewards:digit_reward"}
    config = make_config(two_task_files, tmp_path, steps=3, data={"mixture": {"a": 3.0, "b": 1.0}},
                         reward={"task_field": "task", "default_task": None, "tasks": {"a": digit, "b": digit}})
    trainer = RLTrainer(config)
    try:
        rows = [trainer.train_step_once() for _ in range(config.steps)]
    finally:
        trainer.close()
    share = np.mean([r["reward/a/share"] for r in rows])
    prompts = config.steps * config.rollout.prompts_per_step
    assert abs(share - 0.75) <= 3 * np.sqrt(0.75 * 0.25 / prompts), share


def test_sft_stages_change_the_mixture(two_task_files, tmp_path):
    from jaxrl.trainer.sft import SFTTrainer

    stages = [{"steps": 1, "max_length": 16, "mixture": {"a": 1.0, "b": 0.0}},
              {"steps": 1, "max_length": 16, "mixture": {"a": 0.0, "b": 1.0}}]
    config = make_config(two_task_files, tmp_path, data={"max_response_tokens": 8},
                         sft={"batch_size": 8, "stages": stages})
    trainer = SFTTrainer(config)
    try:
        for stage, task in ((0, "a"), (1, "b")):
            trainer._enter_stage(stage)
            assert {e.row["task"] for _ in range(3) for e in next(trainer.iterator)} == {task}
    finally:
        trainer.close()
