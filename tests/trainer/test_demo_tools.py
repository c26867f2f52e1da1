"""The tools demo (``jaxrl demo --task tools``) at a tiny size: its plumbing, not its learning.

The teacher's SFT conversations are trained on the model's turns only, their tool responses are
the very tokens the calculator environment appends at RL time, the RL phase makes real
calculator calls, and the summary is printed in the main demo's form. The full-size figures are
in docs/agentic.md#the-tools-demo.
"""

import dataclasses
import functools
import os

import numpy as np

from jaxrl import demo
from jaxrl.config import load_config
from jaxrl.data import load_examples, load_tokenizer
from jaxrl.env import EnvRouter
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.metrics import read_jsonl

QUIET = ["logging.progress=false", "logging.tensorboard=false", "logging.plots=false"]


def _config(root: str, name: str) -> TrainConfig:
    return load_config(TrainConfig, os.path.join(demo.CONFIG_DIR, name), demo._overrides(root, []))


def test_teacher_traces_mask_the_tool_responses_the_environment_appends(tmp_path):
    root = str(tmp_path)
    paths = demo.write_tools_demo_files(root, train_prompts=64, heldout=4)
    sft, rl = _config(root, "demo_tools_sft.yaml"), _config(root, "demo_tools.yaml")
    tokenizer = load_tokenizer(paths["tokenizer"])
    assert len(tokenizer) == sft.model.architecture.vocab_size
    examples, report = load_examples(paths["train"], sft.data, tokenizer, with_response=True)
    assert report.bad_rows == 0 and len(examples) == 64
    envs = EnvRouter(rl.env, tokenizer)
    errors = []
    for example in examples:
        env = envs.make(example.row)
        conversation = env.reset(example.row)
        np.testing.assert_array_equal(conversation.token_ids, example.prompt_ids)
        ids = example.response_ids
        call = ids[:list(ids).index(tokenizer.eos_token_id) + 1]  # the model's first turn ends with eos
        step = env.step(conversation, call)
        observation = ids[len(call):len(call) + len(step.observation_ids)]
        np.testing.assert_array_equal(observation, step.observation_ids)
        expected = np.ones(len(ids), np.int32)
        expected[len(call):len(call) + len(observation)] = 0
        np.testing.assert_array_equal(example.response_mask, expected)
        assert ids[-1] == tokenizer.eos_token_id
        errors.append(step.info["tool_errors"])
    assert 0 < np.mean(errors) < 0.5  # the teacher's "**" calls fail, its other calls run


def test_tools_demo_runs_sft_then_multiturn_grpo_with_the_calculator(tmp_path, monkeypatch, capsys):
    tiny = dataclasses.replace(demo.TASKS["tools"],
                               write_files=functools.partial(demo.write_tools_demo_files, train_prompts=512, heldout=8))
    monkeypatch.setitem(demo.TASKS, "tools", tiny)
    code = demo.main([
        "--task", "tools", "--dir", str(tmp_path),
        "--sft", "sft.batch_size=32", "sft.stages=[{steps: 80, max_length: 80}]", *QUIET,
        "--rl", "steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "eval.max_prompts=8",
        "eval.samples=2", "eval.every=0", "checkpoint.directory=", *QUIET])
    out = capsys.readouterr().out
    assert code in (0, 1)  # the rise target is the full demo's; two steps need not meet it
    for line in ("[demo]   before RL ", "[demo] tool-call success rate", "[demo] per-turn mismatch", "[demo] time: "):
        assert line in out, out
    rows = read_jsonl(str(tmp_path / "rl" / "metrics.jsonl"))
    steps = [r for r in rows if "env/tool_calls_per_conversation" in r]
    assert len(steps) == 2
    for row in steps:  # the calculator answered calls: some ran without an error
        assert row["env/tool_calls_per_conversation"] > 0 and row["env/tool_error_rate"] < 1
        assert "mismatch_turn/later_turns_abs_log_ratio_max" in row
    assert rows[0]["heldout/env/tool_calls_per_conversation"] > 0
