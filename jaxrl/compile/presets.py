"""Architecture shapes (the transformers ``config.json`` fields the decoder reads) of models the shipped
configs name, so ``jaxrl compile`` can build them abstractly where the checkpoint is not on disk.

Copied from the models' published ``config.json`` on the Hugging Face hub (Qwen/Qwen3-8B,
Qwen/Qwen3-30B-A3B); only shapes matter here, never weights. A preset is found by name
(``--model-config qwen3-8b``) or by the last folder of ``model.hf_path`` (``/data/models/Qwen3-8B``).
"""

from __future__ import annotations

import json
import os

from jaxrl.errors import InputError

_QWEN3 = {"vocab_size": 151936, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
          "head_dim": 128, "attention_bias": False, "use_sliding_window": False}

PRESETS: dict[str, dict] = {
    "qwen3-8b": {**_QWEN3, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "intermediate_size": 12288, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {**_QWEN3, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                      "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False},
}


def hf_config_for(hf_path: str, model_config: str = "") -> tuple[dict, str]:
    """The ``config.json`` dict of the model to compile and where it came from: ``model_config`` (a preset
    name or a JSON file) when given, else ``hf_path``'s config.json when present, else the preset named
    after ``hf_path``'s last folder. Anything else raises InputError naming what was tried."""
    if model_config:
        if model_config.lower() in PRESETS:
            return PRESETS[model_config.lower()], f"preset {model_config.lower()!r}"
        if not os.path.isfile(model_config):
            raise InputError(f"--model-config {model_config!r} is neither a preset ({sorted(PRESETS)}) nor a file")
        return _read(model_config), model_config
    config_file = os.path.join(hf_path, "config.json")
    if hf_path and os.path.isfile(config_file):
        return _read(config_file), config_file
    name = os.path.basename(os.path.normpath(hf_path)).lower()
    if name in PRESETS:
        return PRESETS[name], f"preset {name!r} ({config_file} is not on this machine)"
    raise InputError(f"model.hf_path={hf_path!r} has no config.json here and names no preset ({sorted(PRESETS)}); "
                     f"pass --model-config PRESET or --model-config path/to/config.json")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: cannot read a JSON config ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object (a transformers config.json)")
    return data
