"""Tiny random transformers Qwen3 / Qwen3-MoE models (PyTorch, CPU) as references for parity tests."""

from __future__ import annotations

import numpy as np
import torch
from flax import nnx
import transformers

VOCAB = 128


def qwen3_config(*, tie: bool, **overrides) -> transformers.Qwen3Config:
    """hidden 36, 6 heads / 2 kv heads (GQA ratio 3), head_dim 10 (not a power of two)."""
    fields = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=tie,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    fields.update(overrides)
    return transformers.Qwen3Config(**fields)


def qwen3_moe_config(*, tie: bool = False, norm_topk_prob: bool = True, **overrides) -> transformers.Qwen3MoeConfig:
    """As qwen3_config with 8 experts, top-3, layer 1 dense (mlp_only_layers)."""
    fields = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=tie, num_experts=8, num_experts_per_tok=3,
                  moe_intermediate_size=16, norm_topk_prob=norm_topk_prob, mlp_only_layers=[1],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    fields.update(overrides)
    return transformers.Qwen3MoeConfig(**fields)


def random_model(hf_config, seed: int = 0):
    """The CausalLM for `hf_config` with every weight random (norm weights around 1), eager attention."""
    torch.manual_seed(seed)
    cls = (transformers.Qwen3MoeForCausalLM if hf_config.model_type == "qwen3_moe"
           else transformers.Qwen3ForCausalLM)
    hf_config._attn_implementation = "eager"
    model = cls(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def padded_batch(seed: int = 0, batch: int = 3, length: int = 9, left: bool = True):
    """input_ids, attention mask and positions [B, T] (numpy): row 0 full, others padded on the
    left (or right) by 2 and 4 tokens; positions count real tokens from 0 (1 on padding)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(batch, length))
    mask = np.ones((batch, length), np.int64)
    for row in range(1, batch):
        pad = 2 * row
        if left:
            mask[row, :pad] = 0
        else:
            mask[row, length - pad:] = 0
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
    return ids, mask, positions


def reference_logits(model, ids, mask, positions, **kwargs):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions), **kwargs)


@nnx.jit
def forward(model, ids, positions, segment_ids):
    """Full-forward logits of a jaxrl Decoder."""
    return model.head(model(ids, positions, segment_ids).hidden)


@nnx.jit
def decode(model, ids, positions, segment_ids, cache):
    """One prefill or decode call of a jaxrl Decoder: (logits, new cache)."""
    out = model(ids, positions, segment_ids, cache=cache)
    return model.head(out.hidden), out.cache
