"""The learner both trainers start from: the policy's Decoder, sharded on the mesh, and the update
options that depend on what that model is."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
from flax import nnx

from jaxrl.distributed.placement import learner_devices
from jaxrl.errors import InputError
from jaxrl.models import Decoder, ModelConfig, create_sharded_model, load_hf_checkpoint, make_mesh
from jaxrl.models.hf import read_hf_config
from jaxrl.models.attention import packed_rows_impl
from jaxrl.models.packing import shared_prefix_blocker


def use_compile_cache(directory: str) -> str | None:
    """Points JAX's persistent compilation cache at ``directory`` (``compile_cache_dir``), so a
    rerun of a config, a resumed run or another process with the same programs loads them instead
    of compiling; returns the folder in use (None: no cache). A cache JAX already has
    (``JAX_COMPILATION_CACHE_DIR``, ``jax.config.update``) is left as it is; an unusable folder
    warns and the run goes on without one. JAX caches the programs that took at least
    ``jax_persistent_cache_min_compile_time_secs`` (1 s) to compile."""
    current = jax.config.jax_compilation_cache_dir
    if current or not directory:
        return current or None
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        logging.getLogger(__name__).warning("compile_cache_dir=%s cannot be used (%s): compiling without a cache; "
                                            "set compile_cache_dir to a writable folder, or '' to turn it off",
                                            directory, e)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def learner_mesh(config) -> jax.sharding.Mesh:
    """The mesh of ``config.mesh`` over the learner's devices: with a ``placement``, each host's
    learner devices in process order; without, the first devices."""
    devices = None
    if config.placement is not None:
        devices = learner_devices(config.placement, jax.process_count(), jax.devices())
    return make_mesh(config.mesh, devices)


def build_model(policy, mesh: jax.sharding.Mesh, packed_rows: bool = False) -> Decoder:
    """The learner's Decoder, sharded on ``mesh``: from ``policy.hf_path`` or a random init. With
    ``packed_rows`` (update.pack, sft.pack) its attention is one that keeps a row's sequences apart:
    ``auto`` runs ``chunked`` where it would be cuDNN (``models.cudnn.packed_rows_impl``)."""
    if packed_rows:
        impl = policy.attention_impl or (policy.architecture.attention_impl if policy.architecture else "auto")
        chosen = packed_rows_impl(impl, mesh.devices.flat[0].platform)
        if chosen != impl:
            logging.getLogger(__name__).info("packed rows: model.attention_impl %s runs %s", impl, chosen)
            policy = dataclasses.replace(policy, attention_impl=chosen)
    if policy.hf_path:
        return load_hf_checkpoint(policy.hf_path, mesh=mesh, **policy.overrides())
    config = policy.architecture.replace(**policy.overrides())
    model, _ = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(policy.init_seed)), mesh)
    return model


def has_experts(policy) -> bool:
    """Whether ``policy`` (a ``PolicyConfig``) builds a model with MoE layers, read before it is built."""
    if not policy.hf_path:
        return policy.architecture.num_experts > 0
    return ModelConfig.from_hf(read_hf_config(policy.hf_path), **policy.overrides()).num_experts > 0


def check_vocabulary(policy, tokenizer, tokenizer_path: str) -> None:
    """Refuses (``InputError``: one line, exit 2), before the model is built, a tokenizer with more tokens
    than ``policy`` (a ``PolicyConfig``) has embedding rows: its ids past the vocabulary have no row (a
    gather out of range reads NaN), so training on them gave NaN updates and a learning-rate hint
    before. A larger model vocabulary (padded, as Qwen3's 151,936 rows for 151,669 tokens) is fine."""
    known = policy.vocab_size()
    tokens = len(tokenizer)
    if known is None or tokens <= known[1]:
        return
    key, rows = known
    raise InputError(f"the tokenizer {tokenizer_path!r} (data.tokenizer) has {tokens} tokens and the model only "
                     f"{rows} ({key}): token ids {rows}..{tokens - 1} would index past its embedding; use the "
                     f"model's own tokenizer, or a model whose vocab_size is at least {tokens}")


def check_update_options(update, model: Decoder, mesh: jax.sharding.Mesh) -> None:
    """Refuses, naming the key, ``update`` options (an ``UpdateConfig``) this model cannot run: routing
    replay and the router z-loss without MoE layers, shared prompts with layers or a kernel that cannot
    see a prompt laid out once."""
    for key, value in (("routing_replay", update.routing_replay), ("router_z_loss", update.router_z_loss)):
        if value and not model.config.moe_layer_indices:
            raise ValueError(f"update.{key} is for MoE models (routers, experts), and this model has no MoE "
                             f"layers; leave update.{key} unset")
    platform = mesh.devices.flat[0].platform
    if update.share_prefix and (blocker := shared_prefix_blocker(model.config, platform)):
        raise ValueError(f"update.share_prefix cannot run on this model: {blocker}")
