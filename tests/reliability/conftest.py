"""Shared pieces of the reliability tests: demo data and a tiny RL run's config as plain data.

The config is a dict (the YAML a user would write), so the same run can go through
``from_dict`` in-process or through ``jaxrl train`` in a subprocess. The reward is the
built-in format check "the response starts with a digit", which a random model meets about
half of the time: a dense signal that moves the parameters, with no user module to import.
"""
import copy

import pytest

from jaxrl.demo import write_demo_files

ARCHITECTURE = {"vocab_size": 17, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                "num_kv_heads": 1, "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 32}


@pytest.fixture(scope="session")
def demo_files(tmp_path_factory):
    return write_demo_files(str(tmp_path_factory.mktemp("demo")), max_operand=10, heldout=10)


def _merge(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.fixture(scope="session")
def run_config(demo_files):
    """``run_config(out, **sections)``: the tiny RL run's config dict writing to folder ``out``."""
    def make(out, **sections) -> dict:
        base = {
            "output_dir": str(out), "steps": 2, "seed": 3,
            "model": {"architecture": ARCHITECTURE, "init_seed": 1},
            "data": {"tokenizer": demo_files["tokenizer"], "train_files": [demo_files["train"]],
                     "use_chat_template": False, "max_prompt_tokens": 6},
            "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6},
            "optimizer": {"lr": 1e-2, "clip_norm": 1.0},
            "reward": {"default_task": "t", "task_field": "none",
                       "tasks": {"t": {"kind": "format", "pattern": "^[0-9]"}}},
            "logging": {"progress": False, "tensorboard": False, "plots": False},
        }
        return _merge(base, sections)

    return make
