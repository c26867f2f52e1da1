"""Small local Hugging Face checkpoints (Qwen3, Qwen3-MoE) for tests and benchmarks.

There is no model hub here: models get random weights from ``transformers`` and a
byte-level BPE tokenizer trained on a few sentences with ``tokenizers``. The
folders load in SGLang and in ``transformers`` alike.
"""

from __future__ import annotations

import os

_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from verifiable rewards trains language models.",
    "def add(a, b):\n    return a + b\n",
    "1 + 1 = 2, 2 * 3 = 6, 10 / 4 = 2.5",
    "SGLang serves tokens; JAX learns from them.",
] * 20


def write_tokenizer(path: str, vocab_size: int) -> None:
    """Trains a byte-level BPE tokenizer of at most ``vocab_size`` ids and saves it to ``path``."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


def qwen3_config(moe: bool = False, **overrides):
    """A tiny Qwen3 (or Qwen3-MoE) config; ``overrides`` replace any field."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    fields = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=0,
        bos_token_id=0, torch_dtype="float32",
    )
    if moe:
        fields.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])
    fields.update(overrides)
    return (Qwen3MoeConfig if moe else Qwen3Config)(**fields)


def write_random_qwen3(path: str, moe: bool = False, seed: int = 0, init_std: float = 0.5, **overrides):
    """Writes a random Qwen3 model plus tokenizer to ``path`` and returns the torch model.

    ``init_std`` is larger than a real model's so the random model's next-token
    distributions are far from uniform (a logprob test on a flat distribution
    cannot tell a temperature-scaled one from a raw one).
    """
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    config = qwen3_config(moe, initializer_range=init_std, **overrides)
    torch.manual_seed(seed)
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config).float().eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    return model
