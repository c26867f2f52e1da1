"""Decoding with a KV cache: prefill then one token per step, per-row positions, padded and ragged rows.

Decode logits are compared with transformers on each row's unpadded sequence (1e-5) and with
our own full forward over the same padded layout (float32; not bit-identical on XLA CPU, whose
dot kernels round differently for 1 query row than for T rows: the residual is bounded in float32
ulps of the row's largest logit).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import load_hf_checkpoint
from models_reference import VOCAB, decode, forward, qwen3_config, qwen3_moe_config, random_model, reference_logits

pytestmark = pytest.mark.fully_optimised  # compared with transformers at float32 rounding (conftest.py)

PROMPT, NEW = 6, 4



def prefill_and_decode(model, ids, positions, segments, prefill_chunks, shared_index=False):
    cache = model.init_cache(ids.shape[0], PROMPT + NEW + 2, shared_index=shared_index)
    pieces, start = [], 0
    for stop in list(prefill_chunks) + list(range(PROMPT + 1, PROMPT + NEW + 1)):
        logits, cache = decode(model, *(jnp.asarray(a[:, start:stop]) for a in (ids, positions, segments)), cache)
        pieces.append(np.asarray(logits))
        start = stop
    np.testing.assert_array_equal(np.asarray(cache.index), PROMPT + NEW)
    return np.concatenate(pieces, axis=1)


@pytest.mark.parametrize("hf_config,left,prefill_chunks,shared_index", [
    (qwen3_config(tie=True), True, (PROMPT,), False),
    (qwen3_config(tie=True), True, (PROMPT,), True),
    (qwen3_moe_config(), False, (PROMPT,), False),
    (qwen3_moe_config(), True, (2, PROMPT), True),
], ids=["dense-left-pad", "dense-left-pad-shared-index", "moe-right-pad-ragged",
        "moe-left-pad-chunked-prefill-shared-index"])
def test_decode_matches_transformers_and_full_forward(tmp_path, hf_config, left, prefill_chunks, shared_index):
    """Left-padded rows write every step at the same cache row, so they may share one write index
    (the embedded sampler's layout: one dynamic-update-slice per cache array, no scatter)."""
    reference = random_model(hf_config, seed=4)
    reference.save_pretrained(tmp_path)
    model = load_hf_checkpoint(str(tmp_path))
    rng = np.random.default_rng(5)
    prompt_lengths = [PROMPT, 4, 2]
    total = PROMPT + NEW
    ids = rng.integers(0, VOCAB, size=(3, total))
    segments = np.ones((3, total), np.int32)
    positions = np.zeros((3, total), np.int32)
    for row, n in enumerate(prompt_lengths):
        pads = slice(0, PROMPT - n) if left else slice(n, PROMPT)
        segments[row, pads] = 0
        positions[row] = np.where(segments[row] == 1, np.cumsum(segments[row]) - 1, 0)
    decoded = prefill_and_decode(model, ids, positions, segments, prefill_chunks, shared_index)
    real = segments == 1
    for row in range(3):
        seq = ids[row][real[row]]
        expected = reference_logits(reference, seq[None], np.ones((1, len(seq)), np.int64),
                                    np.arange(len(seq))[None]).logits.numpy()[0]
        assert np.abs(decoded[row][real[row]] - expected).max() < 1e-5
    full = np.asarray(forward(model, *(jnp.asarray(a) for a in (ids, positions, segments))))
    ulps = (np.abs(decoded - full) / np.spacing(np.abs(full).max(axis=-1, keepdims=True)))[real]
    assert ulps.max() <= 32  # measured 8-10.5 ulps (about 2.5e-6 on logits of magnitude 4.5)


def test_init_cache_rejects_bad_sizes(tmp_path):
    random_model(qwen3_config(tie=False)).save_pretrained(tmp_path)
    model = load_hf_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="max_len=0"):
        model.init_cache(2, 0)
