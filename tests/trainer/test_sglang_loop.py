"""A few RL steps with SGLang as the rollout engine, on a real CPU server (float32).

The learner starts from a random Qwen3 checkpoint that the server also loads; each step
pushes the updated weights to the server (SGLang's own probe check) and the trainer's
spot check compares the server's logprobs of the next batch with the learner's recompute.
"""

import numpy as np
import pytest

from jaxrl.rollout.sglang.server import CPU_VENV_PYTHON

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first"),
]


def digit_reward(prompt, response, response_ids, row):
    from jaxrl.reward import RewardResult

    return RewardResult(score=sum(c.isdigit() for c in response) / max(len(response), 1))


def test_rl_steps_with_sglang_engine(tmp_path):
    import socket

    import jax

    from jaxrl.config import from_dict
    from jaxrl.demo import write_demo_files
    from jaxrl.models import ModelConfig
    from jaxrl.rollout.sglang.testing import write_random_checkpoint
    from jaxrl.trainer.config import TrainConfig
    from jaxrl.trainer.metrics import read_jsonl
    from jaxrl.trainer.rl import RLTrainer

    files = write_demo_files(str(tmp_path / "demo"), max_operand=10, heldout=10)
    model_path = str(tmp_path / "init_hf")
    write_random_checkpoint(model_path, ModelConfig(
        vocab_size=17, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, max_position_embeddings=64), seed=0, matrix_scale=3.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = from_dict(TrainConfig, {
        "output_dir": str(tmp_path / "out"), "steps": 2, "seed": 0,
        "model": {"hf_path": model_path},
        "data": {"tokenizer": files["tokenizer"], "train_files": [files["train"]], "use_chat_template": False,
                 "max_prompt_tokens": 6},
        "reward": {"default_task": "t", "task_field": "none",
                   "tasks": {"t": {"kind": "python", "function": f"{__name__}:digit_reward"}}},
        "rollout": {"engine": "sglang", "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6,
                    "push_tolerance": 1e-4,
                    "sglang": {"server": {"model_path": model_path, "base_port": port,
                                          "log_dir": str(tmp_path / "logs"), "startup_timeout_s": 300},
                               "push": {"checkpoint_dir": str(tmp_path / "pushed"), "probe_ids": [1, 5, 9, 3, 12]}}},
        "optimizer": {"lr": 1e-2},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    })
    trainer = RLTrainer(config)
    try:
        before = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]
        trainer.run()
        after = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]
        assert trainer.engine.weight_version == "2"
    finally:
        trainer.close()
    rows = read_jsonl(str(tmp_path / "out" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # Engine (SGLang) vs learner on every generated token: float32 on both sides.
        assert row["mismatch/abs_log_ratio_max"] < 1e-4
        assert row["push/probe_max_abs_diff"] < 1e-5
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
