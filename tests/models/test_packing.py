"""Sequence packing: the bin packing, the packed layout, and per-sample logprobs equal to one sample per row."""

import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, ModelConfig
from jaxrl.models.packing import first_fit_decreasing, pack_rows
from jaxrl.models.scoring import LogprobScorer

CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=64)


def _rows(lengths, width, seed=0):
    """One-sample rows, next-token aligned: ``lengths[i]`` real columns, then padding."""
    rng = np.random.default_rng(seed)
    n = len(lengths)
    segment_ids = (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    input_ids = rng.integers(1, CONFIG.vocab_size, (n, width)).astype(np.int32) * segment_ids
    targets = rng.integers(1, CONFIG.vocab_size, (n, width)).astype(np.int32) * segment_ids
    positions = np.tile(np.arange(width, dtype=np.int32), (n, 1))
    return input_ids, positions, segment_ids, targets


def test_first_fit_decreasing_by_hand():
    # Sorted: 7 (i=1), 5 (i=0), 4 (i=3), 3 (i=2), 1 (i=4); capacity 8: [7, 1], [5, 3], [4].
    assert first_fit_decreasing([5, 7, 3, 4, 1], 8) == [[1, 4], [0, 2], [3]]
    with pytest.raises(ValueError, match="length 9 does not fit in rows of 8"):
        first_fit_decreasing([9, 1], 8)


def test_packed_rows_hold_each_sample_once_as_its_own_segment():
    lengths = [5, 7, 3, 4, 1, 8, 2, 6]
    inputs = _rows(lengths, 8)
    packed = pack_rows(*inputs, groups=2)
    input_ids = np.asarray(packed.input_ids)
    # Group 0 = samples 0, 2, 4, 6 (5, 3, 1, 2 columns) -> 2 rows; group 1 = 1, 3, 5, 7 (7, 4, 8, 6) -> 4 rows;
    # both get 4 rows (the larger count, a power of two), rows of group m at m, m + 2, ...
    assert input_ids.shape == (8, 8)
    flat = input_ids.reshape(2 * 4, 8)
    for i, width in enumerate(lengths):
        group = i % 2
        local = np.asarray(packed.gather)[i, :width]
        rows_of_group = flat[group::2].reshape(-1)
        np.testing.assert_array_equal(rows_of_group[local], inputs[0][i, :width])
        seg = np.asarray(packed.segment_ids)[group::2].reshape(-1)[local]
        assert len(set(seg.tolist())) == 1 and seg[0] > 0  # one segment per sample
        assert (np.asarray(packed.gather)[i, width:] == 4 * 8).all()  # padding: out of range
        pos = np.asarray(packed.positions)[group::2].reshape(-1)[local]
        np.testing.assert_array_equal(pos, np.arange(width))  # positions restart per sample
    assert packed.padding_fraction == pytest.approx(1 - sum(lengths) / 64)


def test_rows_split_evenly_over_data_parallel_devices():
    packed = pack_rows(*_rows([2, 2, 2, 2, 2, 2], 8), groups=1, devices=4)
    assert np.shape(packed.input_ids)[0] % 4 == 0


def test_packed_logprobs_equal_one_sample_per_row():
    """The learner's per-sample logprobs and entropy do not depend on which samples share a row."""
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    inputs = _rows([13, 3, 21, 8, 1, 17, 5, 11], 24, seed=1)
    alone = LogprobScorer(graphdef)(params, *inputs)
    packed = LogprobScorer(graphdef, pack=True)(params, *inputs)
    live = inputs[2] > 0
    for a, b in zip(alone, packed, strict=True):
        np.testing.assert_allclose(b[live], a[live], rtol=1e-5, atol=1e-5)
        assert (b[~live] == 0).all()
