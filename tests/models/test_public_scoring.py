"""docs/alignment.md's "Your model's logits and logprobs", run as written on a small random Qwen3
checkpoint, and its numbers checked against transformers' on the same folder."""

import os
import re

import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, ModelConfig, save_hf_checkpoint

pytestmark = pytest.mark.fully_optimised  # compared with transformers at float32 rounding (conftest.py)

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                    "alignment.md")


def _example() -> str:
    with open(PAGE) as f:
        text = f.read()
    section = text[text.index("### Your model's logits and logprobs"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_calls_give_transformers_numbers(tmp_path):
    import torch
    import transformers

    config = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=32)
    folder = str(tmp_path / "hf")
    save_hf_checkpoint(Decoder(config, rngs=nnx.Rngs(3)), folder)
    code = _example()
    assert code.count('"path/to/hf_folder"') == 1
    names: dict = {}
    exec(code.replace('"path/to/hf_folder"', repr(folder)), names)  # noqa: S102 - the page's own example
    token_ids, lengths = names["token_ids"], names["lengths"]
    logprobs, logits = np.asarray(names["logprobs"]), np.asarray(names["logits"])
    assert logprobs.shape == token_ids.shape and logits.shape == (*token_ids.shape, config.vocab_size)

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = reference(torch.tensor(token_ids), attention_mask=torch.tensor(
            (np.arange(token_ids.shape[1]) < lengths[:, None]).astype(np.int64))).logits.numpy()
    their_logp = theirs - np.log(np.exp(theirs).sum(-1, keepdims=True))
    for row, length in enumerate(lengths):
        np.testing.assert_allclose(logits[row, :length], theirs[row, :length], atol=1e-5)
        expected = [their_logp[row, t - 1, token_ids[row, t]] for t in range(1, length)]
        np.testing.assert_allclose(logprobs[row, 1:length], expected, atol=1e-5)
        assert logprobs[row, 0] == 0 and not logprobs[row, length:].any()
