"""A few RL steps with SGLang as the rollout engine, on a real CPU server (float32).

The learner starts from a random Qwen3 checkpoint that the server also loads; each step
pushes the updated weights to the server (SGLang's own probe check) and the trainer's
spot check compares the server's logprobs of the next batch with the learner's recompute.
"""

import numpy as np
import pytest

from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON
from server_ports import free_base_port

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first"),
]


def test_rl_steps_with_sglang_engine_synchronous_asynchronous_and_in_memory(tmp_path):
    """One server, three runs: 2 synchronous steps, then 3 with ``rollout.max_staleness=1`` (the
    server generates the next batch while the learner updates), then 2 synchronous steps with
    ``rollout.sglang.push.method=tensor``. The asynchronous run's batches carry versions 0, 0, 1
    (a lag of 0, 1, 1 updates), each push passes the probe check, and the first batch (sampled
    with the learner's own weights) matches its recompute. The in-memory run writes no
    checkpoint, and the server serves each update it hands over: every batch matches the
    learner's recompute. Its ``chunk_mib`` is below the smallest tensor, so each push sends
    every tensor of the checkpoint in a request of its own."""
    import jax

    from jaxrl.config import from_dict
    from jaxrl.demo import write_demo_files
    from jaxrl.models import ModelConfig
    from jaxrl.rollout.sglang import ServerConfig, ServerManager, SGLangEngine
    from jaxrl.rollout.sglang.testing import write_random_checkpoint
    from jaxrl.trainer.config import TrainConfig
    from jaxrl.trainer.metrics import read_jsonl
    from jaxrl.trainer.rl import RLTrainer

    files = write_demo_files(str(tmp_path / "demo"), max_operand=10, heldout=10)
    model_path = str(tmp_path / "init_hf")
    write_random_checkpoint(model_path, ModelConfig(
        vocab_size=17, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, max_position_embeddings=64), seed=0, matrix_scale=3.0)
    server = {"model_path": model_path, "base_port": free_base_port(), "log_dir": str(tmp_path / "logs"),
              "startup_timeout_s": 300}
    push = {"method": "disk", "checkpoint_dir": str(tmp_path / "pushed"), "probe_ids": [1, 5, 9, 3, 12]}

    # 1e-5 MiB = 10 bytes, below the smallest tensor (a norm of head_dim = 8 floats).
    in_memory_push = {**push, "method": "tensor", "checkpoint_dir": str(tmp_path / "never-written"),
                      "chunk_mib": 1e-5}

    def config(name, steps, staleness, push=push):
        return from_dict(TrainConfig, {
            "output_dir": str(tmp_path / name), "steps": steps, "seed": 0,
            "model": {"hf_path": model_path},
            "data": {"tokenizer": files["tokenizer"], "train_files": [files["train"]], "use_chat_template": False,
                     "max_prompt_tokens": 6},
            "reward": {"default_task": "t", "task_field": "none",
                       "tasks": {"t": {"kind": "python", "function": "toy_rewards:digit_reward"}}},
            "rollout": {"engine": "sglang", "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6,
                        "push_tolerance": 1e-4, "max_staleness": staleness,
                        "sglang": {"server": server, "push": push}},
            "optimizer": {"lr": 1e-2},
            "logging": {"progress": False, "tensorboard": False, "plots": False},
        })

    manager = ServerManager(from_dict(ServerConfig, server)).start()
    engines = []
    try:
        runs = {}
        for name, steps, staleness, run_push in (("sync", 2, 0, push), ("async", 3, 1, push),
                                                 ("in_memory", 2, 0, in_memory_push)):
            run_config = config(name, steps, staleness, run_push)
            # The engine the trainer builds from its rollout.sglang section (make_engine), on the
            # server already running. Each trainer pushes its initial weights as version 0.
            engine = SGLangEngine(manager, push=run_config.rollout.sglang.push)
            engines.append(engine)
            trainer = RLTrainer(run_config, engine=engine)
            try:
                before = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]
                trainer.run()
                after = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]
                assert engine.weight_version == str(steps)
            finally:
                trainer.close()
            assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
            runs[name] = read_jsonl(str(tmp_path / name / "metrics.jsonl"))
    finally:
        for engine in engines:
            engine.close()
        manager.stop()
    assert [r["step"] for r in runs["sync"]] == [1, 2]
    for row in runs["sync"]:
        # Engine (SGLang) vs learner on every generated token: float32 on both sides.
        assert row["mismatch/abs_log_ratio_max"] < 1e-4
        assert row["push/probe_max_abs_diff"] < 1e-5
    rows = runs["async"]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert rows[0]["mismatch/abs_log_ratio_max"] < 1e-4 < rows[1]["mismatch/abs_log_ratio_max"]
    assert all(r["push/probe_max_abs_diff"] < 1e-5 for r in rows)
    assert [r["step"] for r in runs["in_memory"]] == [1, 2]
    assert not (tmp_path / "never-written").exists() and engines[2].push_config.method == "tensor"
    from safetensors.numpy import load_file

    num_tensors = len(load_file(f"{model_path}/model.safetensors"))
    for row in runs["in_memory"]:
        assert row["mismatch/abs_log_ratio_max"] < 1e-4 and row["push/probe_max_abs_diff"] < 1e-5
        assert row["push/chunks"] == num_tensors
    assert "push/chunks" not in runs["sync"][0]
