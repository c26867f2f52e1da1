"""Sharded decoder models (Qwen3 dense, Qwen3-MoE, MiniMax, Qwen3-Next) with Hugging Face checkpoint I/O
and the learner's scoring of given tokens."""

from jaxrl.errors import needs_extra

# Without the [train] extra (flax, safetensors) an import below names that extra instead of a bare missing module.
with needs_extra("jaxrl.models"):
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.decoder import ATTENTION_KINDS, DecodeCache, Decoder, DecoderOutput
    from jaxrl.models.hf import load_hf_checkpoint, save_hf_checkpoint
    from jaxrl.models.scoring import LogprobScorer, sequence_logprobs
    from jaxrl.models.sharding import (LOGICAL_AXIS_RULES, MeshConfig, create_sharded_model, make_mesh, shard_model,
                                       state_shardings)

__all__ = [
    "ATTENTION_KINDS", "DecodeCache", "Decoder", "DecoderOutput", "LOGICAL_AXIS_RULES", "LogprobScorer", "MeshConfig",
    "ModelConfig", "create_sharded_model", "load_hf_checkpoint", "make_mesh", "save_hf_checkpoint",
    "sequence_logprobs", "shard_model", "state_shardings",
]
