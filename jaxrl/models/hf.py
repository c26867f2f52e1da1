"""Hugging Face checkpoints (transformers format) <-> `Decoder`, for Qwen3, Qwen3-MoE, MiniMax
and Qwen3-Next.

On disk: `config.json` plus `model.safetensors` or a sharded `model.safetensors.index.json`,
tensor names and layouts as in transformers' original checkpoints (per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight`; MiniMax `block_sparse_moe.experts.{e}.w1/w3/w2`),
which transformers and SGLang both load. MiniMax checkpoints also hold the lightning layers'
decay tables (buffers derived from the config): skipped on load, recomputed on save.
"""

from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl import distributed
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.sharding import state_shardings

NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


class TensorMap(NamedTuple):
    """One parameter of ours (`path` in nnx.state) made of HF tensors `hf_names`.
    `load(list of HF arrays) -> ours`; `save(ours) -> list of HF arrays`."""

    path: tuple
    hf_names: tuple[str, ...]
    load: Callable[[list[np.ndarray]], np.ndarray]
    save: Callable[[np.ndarray], list[np.ndarray]]


def _transposed(path, name):
    return TensorMap(path, (name,), lambda ws: ws[0].T, lambda w: [w.T])


def _same(path, name):
    return TensorMap(path, (name,), lambda ws: ws[0], lambda w: [w])


def _heads_in(path, name, heads, head_dim):
    """HF [H*Dh, D] <-> ours [D, H, Dh]."""
    return TensorMap(path, (name,), lambda ws: ws[0].T.reshape(-1, heads, head_dim),
                     lambda w: [w.reshape(w.shape[0], -1).T])


def _heads_out(path, name, heads, head_dim):
    """HF [D, H*Dh] <-> ours [H, Dh, D]."""
    return TensorMap(path, (name,), lambda ws: ws[0].T.reshape(heads, head_dim, -1),
                     lambda w: [w.reshape(heads * head_dim, -1).T])


def _experts(path, names):
    """HF per-expert [out, in] tensors <-> ours [E, in, out]."""
    return TensorMap(path, tuple(names), lambda ws: np.stack([w.T for w in ws]), lambda w: [e.T for e in w])


def _conv(path, name):
    """HF depthwise Conv1d [C, 1, K] <-> ours [K, C]."""
    return TensorMap(path, (name,), lambda ws: ws[0][:, 0, :].T, lambda w: [w.T[:, None, :]])


# Linear-attention kinds: (HF module name, {our parameter: (HF tensor suffix, map)}).
LINEAR_LAYER_TENSORS = {
    "lightning_attention": ("self_attn", {
        "qkv_proj": ("qkv_proj.weight", _transposed), "output_gate": ("output_gate.weight", _transposed),
        "out_proj": ("out_proj.weight", _transposed), "norm": ("norm.weight", _same)}),
    "gated_deltanet": ("linear_attn", {
        "in_proj_qkvz": ("in_proj_qkvz.weight", _transposed), "in_proj_ba": ("in_proj_ba.weight", _transposed),
        "conv1d": ("conv1d.weight", _conv), "dt_bias": ("dt_bias", _same), "A_log": ("A_log", _same),
        "norm": ("norm.weight", _same), "out_proj": ("out_proj.weight", _transposed)}),
}
# MoE tensor names per family: (module, router, {our expert projection: HF name}).
MOE_TENSORS = {
    "minimax": ("block_sparse_moe", "gate", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
    "default": ("mlp", "gate", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """Every parameter of `Decoder(config)` and the HF tensors it corresponds to."""
    c = config
    maps = [_same(("embed",), "model.embed_tokens.weight"), _same(("final_norm", "weight"), "model.norm.weight")]
    if not c.tie_word_embeddings:
        maps.append(_transposed(("lm_head",), "lm_head.weight"))
    moe_module, router, expert_names = MOE_TENSORS.get(c.hf_family, MOE_TENSORS["default"])
    q_width = 2 * c.head_dim if c.attention_output_gate else c.head_dim
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}", ("layers", i)
        maps += [
            _same(ours + ("input_norm", "weight"), f"{hf}.input_layernorm.weight"),
            _same(ours + ("post_attention_norm", "weight"), f"{hf}.post_attention_layernorm.weight"),
        ]
        if c.layer_types[i] in LINEAR_LAYER_TENSORS:
            module, params = LINEAR_LAYER_TENSORS[c.layer_types[i]]
            maps += [make(ours + ("attn", name), f"{hf}.{module}.{suffix}") for name, (suffix, make) in params.items()]
        else:
            maps += [
                _heads_in(ours + ("attn", "q_proj"), f"{hf}.self_attn.q_proj.weight", c.num_heads, q_width),
                _heads_in(ours + ("attn", "k_proj"), f"{hf}.self_attn.k_proj.weight", c.num_kv_heads, c.head_dim),
                _heads_in(ours + ("attn", "v_proj"), f"{hf}.self_attn.v_proj.weight", c.num_kv_heads, c.head_dim),
                _heads_out(ours + ("attn", "o_proj"), f"{hf}.self_attn.o_proj.weight", c.num_heads, c.head_dim),
            ]
            if c.qk_norm:
                maps += [_same(ours + ("attn", "q_norm", "weight"), f"{hf}.self_attn.q_norm.weight"),
                         _same(ours + ("attn", "k_norm", "weight"), f"{hf}.self_attn.k_norm.weight")]
        if c.mlp_types[i] == "moe":
            maps.append(_transposed(ours + ("mlp", "router"), f"{hf}.{moe_module}.{router}.weight"))
            for proj, hf_proj in expert_names.items():
                names = [f"{hf}.{moe_module}.experts.{e}.{hf_proj}.weight" for e in range(c.num_experts)]
                maps.append(_experts(ours + ("mlp", proj), names))
            if c.shared_expert_intermediate_size:
                maps += [_transposed(ours + ("mlp", "shared_expert", proj), f"{hf}.mlp.shared_expert.{proj}.weight")
                         for proj in ("gate_proj", "up_proj", "down_proj")]
            if c.shared_expert_gate and c.shared_expert_intermediate_size:
                maps.append(_transposed(ours + ("mlp", "shared_expert_gate"), f"{hf}.mlp.shared_expert_gate.weight"))
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                maps.append(_transposed(ours + ("mlp", proj), f"{hf}.mlp.{proj}.weight"))
    return maps


def derived_tensors(config: ModelConfig) -> dict[str, np.ndarray]:
    """Buffers transformers stores in MiniMax checkpoints, recomputed from the config as
    `MiniMaxLightningAttention.decay_factors` does (float32)."""
    from jaxrl.models.linear_layers import lightning_log_decay

    c, tensors = config, {}
    steps = np.arange(1, c.linear_chunk_size + 1, dtype=np.float32)
    for i, kind in enumerate(c.layer_types):
        if kind != "lightning_attention":
            continue
        slope = -np.asarray(lightning_log_decay(c.num_heads, i, c.num_layers), np.float32)[:, None, None]
        gap = steps[:, None] - steps[None, :]
        prefix = f"model.layers.{i}.self_attn"
        tensors.update({
            f"{prefix}.slope_rate": slope,
            f"{prefix}.query_decay": np.exp(-slope * steps[:, None]),
            f"{prefix}.key_decay": np.exp(-slope * (c.linear_chunk_size - steps[:, None])),
            f"{prefix}.diagonal_decay": np.exp(np.where(gap >= 0, -slope * gap, -np.inf))[None].astype(np.float32),
        })
    return tensors


def _tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}


def read_hf_config(path: str) -> dict:
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{config_file} not found: a transformers checkpoint folder needs a config.json")
    with open(config_file) as f:
        return json.load(f)


def load_hf_checkpoint(path: str, *, mesh: jax.sharding.Mesh | None = None, **config_overrides) -> Decoder:
    """Load a transformers Qwen3 / Qwen3-MoE folder into a `Decoder`, sharded on `mesh` if given.

    `config_overrides` set ModelConfig fields such as `param_dtype`, `dtype`, `remat`; the
    parameter dtype defaults to the checkpoint's `torch_dtype`/`dtype` (float32 if neither is
    float32/bfloat16). Each host array is sliced per device, so no device holds a full tensor
    it does not own. Unknown, missing or misshapen tensors raise ValueError naming the tensor.
    """
    hf_config = read_hf_config(path)
    stored_dtype = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    config_overrides.setdefault("param_dtype", stored_dtype if stored_dtype in NUMPY_DTYPES else "float32")
    config = ModelConfig.from_hf(hf_config, **config_overrides)
    maps = tensor_maps(config)
    files = _tensor_files(path)
    expected = {name for m in maps for name in m.hf_names}
    unknown = sorted(set(files) - expected - set(derived_tensors(config)))
    if config.tie_word_embeddings and "lm_head.weight" in unknown:
        unknown.remove("lm_head.weight")  # some tied checkpoints store the copy; checked below
    if unknown:
        raise ValueError(f"checkpoint {path} has tensors the {hf_config['model_type']} model does not: "
                         f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''} ({len(unknown)} in all)")
    missing = sorted(expected - set(files))
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"({len(missing)} in all)")

    handles: dict[str, object] = {}

    def read(name: str) -> np.ndarray:
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="numpy").__enter__()
        return handles[file].get_tensor(name)

    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh) if mesh is not None else None
    flat = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    param_dtype = NUMPY_DTYPES[config.param_dtype]
    for m in maps:
        var = flat[m.path]
        value = np.ascontiguousarray(m.load([read(n) for n in m.hf_names]).astype(param_dtype))
        if value.shape != var.shape:
            raise ValueError(f"checkpoint tensor(s) {m.hf_names[0]}{' ...' if len(m.hf_names) > 1 else ''} give "
                             f"shape {value.shape} but config.json implies {var.shape}")
        if m.path in flat_shardings:
            array = jax.make_array_from_callback(value.shape, flat_shardings[m.path], lambda index, v=value: v[index])
        else:
            array = jax.numpy.asarray(value)
        flat[m.path] = var.replace(array)
    if config.tie_word_embeddings and "lm_head.weight" in files:
        if not np.array_equal(read("lm_head.weight"), read("model.embed_tokens.weight")):
            raise ValueError(f"checkpoint {path} has tie_word_embeddings=true but an lm_head.weight that differs "
                             "from model.embed_tokens.weight; set tie_word_embeddings=false in config.json")
    for handle in handles.values():
        handle.__exit__(None, None, None)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_hf_checkpoint(model: Decoder, path: str) -> None:
    """Write `config.json` and `model.safetensors` (transformers layout, parameter dtype) to `path`.

    With several JAX processes every process must call this (gathering parameters spread over
    processes is a collective); process 0 alone writes, and all return once the files are complete.
    """
    config = model.config
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    tensors = {}
    for m in tensor_maps(config):
        # One parameter at a time: the other processes never hold more than one gathered tensor.
        value = distributed.to_host(flat[m.path][...])
        if distributed.is_main_process():
            for name, array in zip(m.hf_names, m.save(value)):
                tensors[name] = np.ascontiguousarray(array)
    if distributed.is_main_process():
        tensors.update(derived_tensors(config))
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config.to_hf(), f, indent=2, sort_keys=True)
    if jax.process_count() > 1:
        # The others may read the folder next (a push to an inference server): not before it is written.
        multihost_utils.sync_global_devices(f"jaxrl save_hf_checkpoint {path}")
