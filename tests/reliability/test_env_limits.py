"""Environment limits checked against the model at load (docs/agentic.md#configuration).

Before: ``env.tasks.<task>.limits.max_total_tokens=100000`` with a 128-position model was accepted;
the trainer sized every learner row by it and ran one step for over 10 minutes at 2.9 GB. A
conversation can be no longer than the model's positions, so ``jaxrl train`` now refuses such a
limit at load (exit 2, one line naming both keys and values, nothing written), whether the
positions come from ``model.architecture`` or from the checkpoint's config.json, and for a
built-in (``kind: tools``) or a user's (``kind: python``) environment alike.

The refused values here are one past the model's positions, so that the unchecked code trains
(and exits 0) quickly instead of running the issue's ten-minute step.
"""

import json

import pytest

from jaxrl.cli import main
from jaxrl.config import from_dict
from jaxrl.models import ModelConfig
from jaxrl.rollout.sglang.testing import write_random_checkpoint
from jaxrl.trainer.config import TrainConfig

POSITIONS = 32  # the max_position_embeddings of conftest.ARCHITECTURE, the tiny model run_config trains
CALCULATOR = {"kind": "tools", "tools": ["calculator"]}


def user_environment(tokenizer, task):
    raise AssertionError("never built: the config is refused first")


def _env(limits: dict, task: dict = CALCULATOR) -> dict:
    return {"task_field": "none", "default_task": "calc", "use_chat_template": False,
            "tasks": {"calc": {**task, "limits": {"max_turns": 2, **limits}}}}


def _train(config: dict, tmp_path, capsys) -> tuple[int, str]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = main(["train", str(path)])
    return code, capsys.readouterr().err


def test_train_refuses_a_conversation_longer_than_the_architecture(run_config, tmp_path, capsys):
    out = tmp_path / "out"
    config = run_config(out, steps=1, env=_env({"max_total_tokens": POSITIONS + 1}))
    assert config["model"]["architecture"]["max_position_embeddings"] == POSITIONS
    code, err = _train(config, tmp_path, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"env.tasks.calc.limits.max_total_tokens={POSITIONS + 1}" in err
    assert f"model.architecture.max_position_embeddings={POSITIONS}" in err
    assert not out.exists()  # refused before anything is written


def test_train_refuses_a_conversation_longer_than_the_checkpoint(run_config, tmp_path, capsys):
    config = run_config(tmp_path / "out", steps=1, env=_env({"max_total_tokens": 65}))
    checkpoint = tmp_path / "hf"
    architecture = {**config["model"]["architecture"], "max_position_embeddings": 64}
    write_random_checkpoint(str(checkpoint), ModelConfig(**architecture))
    config["model"] = {"hf_path": str(checkpoint)}
    code, err = _train(config, tmp_path, capsys)
    assert code == 2, err
    assert "env.tasks.calc.limits.max_total_tokens=65" in err
    assert f"max_position_embeddings=64 in {checkpoint / 'config.json'} (model.hf_path)" in err


def test_user_environments_are_checked_too(run_config, tmp_path):
    """A ``kind: python`` environment's configured limits size the learner's rows as well."""
    user = {"kind": "python", "environment": f"{__name__}:user_environment"}
    with pytest.raises(ValueError, match=f"max_total_tokens=100000 exceeds .*max_position_embeddings={POSITIONS}"):
        from_dict(TrainConfig, run_config(tmp_path, env=_env({"max_total_tokens": 100_000}, user)))


def test_a_conversation_as_long_as_the_model_is_accepted(run_config, tmp_path):
    config = from_dict(TrainConfig, run_config(tmp_path, env=_env({"max_total_tokens": POSITIONS})))
    assert config.env.tasks["calc"].limits.max_total_tokens == POSITIONS
