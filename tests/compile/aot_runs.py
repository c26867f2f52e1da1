"""``jaxrl compile`` as a user runs it, in the ahead-of-time venv of a platform (``.venv-tpu``,
``.venv-cuda-aot``), over a small RL config: shared by the TPU and GPU tests."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
TPU_PYTHON = ROOT / ".venv-tpu" / "bin" / "python"
CUDA_PYTHON = ROOT / ".venv-cuda-aot" / "bin" / "python"

ARCHITECTURE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=512)
MOE = dict(ARCHITECTURE, mlp_types=["moe", "moe"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
# One layer, but 2 x 262144 x 12288 embedding and LM head weights: with AdamW's moments 12 bytes a weight,
# 72 GiB over 4 devices (a small graph, so it compiles fast).
OVERSIZED = dict(ARCHITECTURE, vocab_size=262144, hidden_size=12288, num_heads=96, num_kv_heads=8, head_dim=128,
                 num_layers=1)


def rl_config(tmp_path, architecture, mesh, evaluate: bool = False, scan_layers: bool = False,
              attention_impl: str = "auto", **sections) -> str:
    """An RL config over ``architecture`` (random init: nothing is read); ``evaluate`` adds held-out
    files, so the eval sampler's program compiles too."""
    config = {
        "output_dir": str(tmp_path / "run"), "steps": 10,
        "model": {"architecture": architecture, "dtype": "bfloat16", "remat": "save_dots",
                  "attention_impl": attention_impl, "attention_block_size": 128, "scan_layers": scan_layers},
        "mesh": mesh,
        "data": {"tokenizer": "unused", "train_files": ["unused.jsonl"],
                 "eval_files": ["unused.jsonl"] if evaluate else [], "max_prompt_tokens": 64},
        "reward": {"tasks": {"math": {"kind": "math"}}, "default_task": "math"},
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 192},
        "update": {"mini_batches": 2, "micro_batches": 2},
        "eval": {"max_prompts": 8, "samples": 1},
        **sections,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def sft_config(tmp_path, architecture, mesh, stages: list[dict], attention_impl: str = "auto",
               sft: dict | None = None) -> str:
    """An SFT config (what ``jaxrl sft`` runs) over ``architecture`` with the length curriculum ``stages``;
    ``sft``: further keys of its ``sft`` section."""
    config = {
        "output_dir": str(tmp_path / "run"),
        "model": {"architecture": architecture, "dtype": "bfloat16", "remat": "full", "attention_impl": attention_impl,
                  "attention_block_size": 128, "scan_layers": True},
        "mesh": mesh,
        "data": {"tokenizer": "unused", "train_files": ["unused.jsonl"]},
        "sft": {"batch_size": 4, "micro_batches": 2, "stages": stages, **(sft or {})},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def compile_config(python: pathlib.Path, config: str, topology: str, tmp_path,
                   *extra) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``jaxrl compile CONFIG --topology TOPOLOGY --json`` in ``python``'s venv; the run and its report."""
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run([str(python), "-m", "jaxrl.cli", "compile", config, "--topology", topology,
                           "--json", str(report), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    sys.stdout.write(done.stdout)
    return done, json.loads(report.read_text()) if report.exists() else None


def programs_by_name(report: dict) -> dict:
    return {p["name"]: p for p in report["programs"]}
