"""Sharded decoder models (Qwen3 dense, Qwen3-MoE) with Hugging Face checkpoint I/O."""

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import ATTENTION_KINDS, DecodeCache, Decoder, DecoderOutput
from jaxrl.models.hf import load_hf_checkpoint, save_hf_checkpoint
from jaxrl.models.sharding import (LOGICAL_AXIS_RULES, MeshConfig, TrainStep, abstract_train_state, build_train_step,
                                   create_sharded_model, make_mesh, make_train_step, shard_model, state_shardings)

__all__ = [
    "ATTENTION_KINDS", "DecodeCache", "Decoder", "DecoderOutput", "LOGICAL_AXIS_RULES", "MeshConfig", "ModelConfig",
    "TrainStep", "abstract_train_state", "build_train_step", "create_sharded_model", "load_hf_checkpoint",
    "make_mesh", "make_train_step", "save_hf_checkpoint", "shard_model", "state_shardings",
]
