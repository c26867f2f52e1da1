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
from typing import Callable, Iterator, NamedTuple

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl import distributed
from jaxrl.errors import InputError, InputFileNotFoundError, one_line
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


_RESAVE = "copy the checkpoint again, or re-save it (save_pretrained / jaxrl.models.save_hf_checkpoint)"


def _open_safetensors(file: str):
    """An open safetensors handle; a truncated or corrupt file raises InputError naming it."""
    try:
        return safe_open(file, framework="numpy")
    except Exception as e:  # safetensors' SafetensorError (not an OSError), or an OSError
        raise InputError(f"{file} is not a readable safetensors file ({one_line(e)}); it is truncated or "
                         f"corrupt: {_RESAVE}") from e


def _read_json(file: str, what: str) -> dict:
    try:
        with open(file, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except (ValueError, OSError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise InputError(f"{file} is not valid JSON ({one_line(e)}); {what}") from e
    if not isinstance(value, dict):
        raise InputError(f"{file} holds a JSON {type(value).__name__}, not an object; {what}")
    return value


def _tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _read_json(index, f"a sharded checkpoint's index maps tensor names to files; {_RESAVE}")
        weight_map = weight_map.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InputError(f"{index} has no \"weight_map\" object (tensor name -> file); {_RESAVE}")
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        absent = sorted({file for file in files.values() if not os.path.isfile(file)})
        if absent:
            raise InputFileNotFoundError(
                f"{index} names shard files that are missing: {absent[:3]}{' ...' if len(absent) > 3 else ''} "
                f"({len(absent)} in all); {_RESAVE}")
        for file in sorted(set(files.values())):
            with _open_safetensors(file):  # a truncated shard fails here, before any reading
                pass
        return files
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise InputFileNotFoundError(
            f"{path} holds neither model.safetensors nor model.safetensors.index.json; expected a transformers "
            "checkpoint folder (config.json + *.safetensors)")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def read_hf_config(path: str) -> dict:
    """The checkpoint folder's config.json as a dict; a missing folder or file, or one that is not a
    JSON object, raises InputError naming the path."""
    expected = "expected a transformers checkpoint folder (config.json + *.safetensors)"
    if not os.path.exists(path):
        raise InputFileNotFoundError(f"model folder {path!r} does not exist; {expected}")
    if not os.path.isdir(path):
        raise InputError(f"model folder {path!r} is a file, not a folder; {expected}")
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise InputFileNotFoundError(
            f"{config_file} not found: a transformers checkpoint folder needs a config.json; {expected}")
    return _read_json(config_file, "it should be the model's config as written by save_pretrained")


def _model_config(path: str, hf_config: dict, overrides: dict, given: dict) -> ModelConfig:
    """ModelConfig.from_hf; a config.json it cannot read raises InputError naming the file
    (``given``: the overrides the caller passed, named in the message)."""
    config_file = os.path.join(path, "config.json")
    try:
        return ModelConfig.from_hf(hf_config, **overrides)
    except KeyError as e:
        raise InputError(f"{config_file} lacks the field {e.args[0]!r}, which the "
                         f"{hf_config.get('model_type')!r} model needs") from e
    except (TypeError, ValueError) as e:
        with_overrides = f" with overrides {given}" if given else ""
        raise InputError(f"{config_file}{with_overrides}: {one_line(e, 500)}") from e


def load_hf_checkpoint(path: str, *, mesh: jax.sharding.Mesh | None = None, **config_overrides) -> Decoder:
    """Load a transformers Qwen3 / Qwen3-MoE folder into a `Decoder`, sharded on `mesh` if given.

    `config_overrides` set ModelConfig fields such as `param_dtype`, `dtype`, `remat`; the
    parameter dtype defaults to the checkpoint's `torch_dtype`/`dtype` (float32 if neither is
    float32/bfloat16). Each host array is sliced per device, so no device holds a full tensor
    it does not own.

    Bad input raises ``jaxrl.errors.InputError`` (a ValueError) naming the path: a missing
    folder or config.json, a config.json that is not JSON or names another architecture, a
    truncated or corrupt safetensors file or index, unknown, missing or misshapen tensors.
    """
    hf_config = read_hf_config(path)
    given = dict(config_overrides)
    stored_dtype = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    config_overrides.setdefault("param_dtype", stored_dtype if stored_dtype in NUMPY_DTYPES else "float32")
    config = _model_config(path, hf_config, config_overrides, given)
    maps = tensor_maps(config)
    files = _tensor_files(path)
    expected = {name for m in maps for name in m.hf_names}
    unknown = sorted(set(files) - expected - set(derived_tensors(config)))
    if config.tie_word_embeddings and "lm_head.weight" in unknown:
        unknown.remove("lm_head.weight")  # some tied checkpoints store the copy; checked below
    if unknown:
        raise InputError(f"checkpoint {path} has tensors the {hf_config['model_type']} model does not: "
                         f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''} ({len(unknown)} in all)")
    missing = sorted(expected - set(files))
    if missing:
        raise InputError(f"checkpoint {path} is missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"({len(missing)} in all)")

    handles: dict[str, object] = {}

    def read(name: str) -> np.ndarray:
        file = files[name]
        if file not in handles:
            handles[file] = _open_safetensors(file).__enter__()
        try:
            return handles[file].get_tensor(name)
        except Exception as e:  # SafetensorError: the header promises bytes the file does not hold
            raise InputError(f"{file}: tensor {name!r} cannot be read ({one_line(e)}); {_RESAVE}") from e

    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh) if mesh is not None else None
    flat = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    param_dtype = NUMPY_DTYPES[config.param_dtype]
    try:
        for m in maps:
            var = flat[m.path]
            names = f"{m.hf_names[0]}{' ...' if len(m.hf_names) > 1 else ''}"
            stored = [read(n) for n in m.hf_names]
            try:
                value = np.ascontiguousarray(m.load(stored).astype(param_dtype))
            except ValueError as e:  # a reshape that the stored size does not allow
                raise InputError(f"checkpoint {path}: tensor(s) {names} of shape {stored[0].shape} do not fit "
                                 f"config.json, which implies {var.shape} ({one_line(e)})") from e
            if value.shape != var.shape:
                raise InputError(f"checkpoint {path}: tensor(s) {names} give shape {value.shape} but config.json "
                                 f"implies {var.shape}")
            if m.path in flat_shardings:
                array = jax.make_array_from_callback(value.shape, flat_shardings[m.path],
                                                     lambda index, v=value: v[index])
            else:
                array = jax.numpy.asarray(value)
            flat[m.path] = var.replace(array)
        if config.tie_word_embeddings and "lm_head.weight" in files:
            if not np.array_equal(read("lm_head.weight"), read("model.embed_tokens.weight")):
                raise InputError(f"checkpoint {path} has tie_word_embeddings=true but an lm_head.weight that "
                                 "differs from model.embed_tokens.weight; set tie_word_embeddings=false in config.json")
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _saved_tensors(model: Decoder, place: Callable):
    """(HF name, tensor) for every parameter of ``model``, each laid out by its map's ``save`` on
    ``place(parameter)`` (the jax array itself, or a host view of it), one parameter at a time."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    for m in tensor_maps(model.config):
        yield from zip(m.hf_names, m.save(place(flat[m.path][...])), strict=True)


def hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
    """The tensors a transformers checkpoint of ``model`` holds, by name, on the host (parameter
    dtype; MiniMax's derived buffers included).

    With several JAX processes every process must call this (gathering parameters spread over
    processes is a collective); process 0 gets the tensors, the others an empty dict.
    """
    tensors = {}
    # On the device, one parameter at a time: XLA lays out the transposes (about 4x numpy's
    # strided copy on CPU), and no process ever holds more than one gathered tensor.
    for name, array in _saved_tensors(model, lambda x: x):
        value = distributed.gather_to_hosts(array)
        if distributed.is_main_process():
            tensors[name] = np.ascontiguousarray(value)
    if distributed.is_main_process():
        tensors.update(derived_tensors(model.config))
    return tensors


class TensorStream(NamedTuple):
    """A checkpoint's tensors, announced before they are made: ``specs`` gives every name's shape
    and dtype in order, ``arrays`` yields ``(name, host array)`` in that order, one at a time."""

    specs: dict[str, tuple[tuple[int, ...], np.dtype]]
    arrays: Iterator[tuple[str, np.ndarray]]

    @classmethod
    def of(cls, tensors: dict[str, np.ndarray]) -> "TensorStream":
        return cls({k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in tensors.items()}, iter(tensors.items()))


def hf_tensor_stream(model: Decoder) -> TensorStream:
    """The tensors of :func:`hf_tensors` as host views of the parameters, each made when the stream
    reaches it, for a consumer that copies each once (the in-memory SGLang push copies them straight
    into its shared buffers): nothing is copied where a parameter already lives in this process's
    host memory (numpy views, mostly transposed, so not contiguous), and with several JAX processes
    each parameter is gathered from them all (:func:`jaxrl.distributed.gather_to_hosts`: a collective
    over one device per process, so every process reads the stream to its end, in step). A view is valid
    while the model's arrays live."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    maps = tensor_maps(model.config)
    derived = derived_tensors(model.config)
    specs = {}
    for m in maps:
        value = flat[m.path][...]
        saved = jax.eval_shape(m.save, jax.ShapeDtypeStruct(value.shape, value.dtype))
        specs.update((name, (tuple(s.shape), np.dtype(s.dtype))) for name, s in zip(m.hf_names, saved, strict=True))
    specs.update((name, (tuple(v.shape), np.dtype(v.dtype))) for name, v in derived.items())

    def arrays():
        yield from _saved_tensors(model, distributed.gather_to_hosts)
        yield from derived.items()

    return TensorStream(specs, arrays())


def save_hf_checkpoint(model: Decoder, path: str) -> None:
    """Write `config.json` and `model.safetensors` (transformers layout, parameter dtype) to `path`.

    With several JAX processes every process must call this (see :func:`hf_tensors`); process 0
    alone writes, and all return once the files are complete.
    """
    config = model.config
    tensors = hf_tensors(model)
    if distributed.is_main_process():
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        os.chmod(os.path.join(path, "model.safetensors"), 0o644)  # safetensors writes it 0600, unlike any save
        # config.json last and whole (renamed into place): a folder with one holds a complete checkpoint.
        with open(os.path.join(path, "config.json.tmp"), "w") as f:
            json.dump(config.to_hf(), f, indent=2, sort_keys=True)
        os.replace(os.path.join(path, "config.json.tmp"), os.path.join(path, "config.json"))
    if jax.process_count() > 1:
        # The others may read the folder next (a push to an inference server): not before it is written.
        multihost_utils.sync_global_devices(f"jaxrl save_hf_checkpoint {path}")
