"""What a new user's first own task meets first, through ``jaxrl train``: a reward module beside the
config, a model smaller than the tokenizer, a tokenizer without the tokens the trainer needs.

The reward module is written beside the config at run time, under a name of its own per test
(the reward worker imports it by name from the config folder on ``sys.path``).
"""

import json
import os
import shutil
import sys
import uuid

import pytest

from cli_checks import one_line_exit_2, write_config
from jaxrl.cli import main
from jaxrl.data import load_tokenizer

REWARD = '''
from jaxrl.reward import RewardResult


def starts_with_a_digit(prompt, response, response_ids, row):
    return RewardResult(score=float(response[:1].isdigit()))
'''


def _tokenizer_without(tmp_path, demo_files, token: str) -> str:
    """The demo tokenizer with ``token`` ("eos_token", "pad_token") left out of its config."""
    folder = tmp_path / f"tokenizer-without-{token}"
    shutil.copytree(demo_files["tokenizer"], folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config[token]
    config_file.write_text(json.dumps(config))
    return str(folder)


def test_a_reward_module_beside_the_config_is_imported(tmp_path, run_config, monkeypatch):
    """``jaxrl train my_task/config.yaml`` with ``function: my_rewards:score`` in ``my_task/``: the
    console script's sys.path holds neither the config's folder nor (unlike ``python -m``) the
    working directory; before, that was 'cannot be imported' unless the user set PYTHONPATH."""
    module = f"my_rewards_{uuid.uuid4().hex[:8]}"
    task = tmp_path / "my_task"
    task.mkdir()
    (task / f"{module}.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)  # not the config's folder
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    config = run_config(tmp_path / "out", reward={"tasks": {"t": {"kind": "python",
                                                                 "function": f"{module}:starts_with_a_digit"}}})
    assert main(["train", write_config(task, config)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0.0 <= row["reward/mean"] <= 1.0 for row in rows)


def test_a_model_smaller_than_its_tokenizer_is_named(tmp_path, run_config, demo_files, capfd):
    """Before: NaN updates and a hint to lower the learning rate."""
    tokens = len(load_tokenizer(demo_files["tokenizer"]))
    config = run_config(tmp_path / "out", model={"architecture": {"vocab_size": tokens - 5}})
    one_line_exit_2(capfd, ["train", write_config(tmp_path, config)],
                     f"(data.tokenizer) has {tokens} tokens and the model only {tokens - 5} "
                     f"(model.architecture.vocab_size={tokens - 5}): token ids {tokens - 5}..{tokens - 1}")


def test_a_tokenizer_without_eos_is_named(tmp_path, run_config, demo_files, capfd):
    folder = _tokenizer_without(tmp_path, demo_files, "eos_token")
    config = run_config(tmp_path / "out", data={"tokenizer": folder})
    one_line_exit_2(capfd, ["train", write_config(tmp_path, config)],
                     f"tokenizer at {folder!r} has no eos token; generation could never stop. Set eos_token")


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_tokenizer_without_pad_pads_with_eos(tmp_path, run_config, demo_files, command):
    """A pad only fills rows and is masked out of every loss, so the eos token does (before: a
    TypeError traceback, int(None), from the pad id in both trainers)."""
    folder = _tokenizer_without(tmp_path, demo_files, "pad_token")
    tokenizer = load_tokenizer(folder)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    config = run_config(tmp_path / "out", data={"tokenizer": folder},
                        sft={"batch_size": 4, "stages": [{"steps": 2, "max_length": 16}]})
    assert main([command, write_config(tmp_path, config)]) == 0


@pytest.mark.parametrize("command", ["train", "sft"])
def test_cudnn_attention_with_packed_rows_is_named(tmp_path, run_config, capfd, command):
    """cuDNN masks a row by its length, so packed rows would see each other's tokens: refused before the
    model is built (``auto`` runs chunked for packed rows instead: tests/models/test_attention.py)."""
    packed = {"update": {"pack": True}} if command == "train" else {"sft": {"pack": True, "stages": [
        {"steps": 1, "max_length": 16}]}}
    config = run_config(tmp_path / "out", model={"attention_impl": "cudnn"}, **packed)
    config["data"]["response_field"] = "answer"
    one_line_exit_2(capfd, [command, write_config(tmp_path, config)],
                    "model.attention_impl: cudnn masks a row by its length, so it cannot keep the sequences of a "
                    "packed row apart; set update.pack (sft.pack) to false")
