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


# ---- shared prefixes ----------------------------------------------------------------------------------


def _groups_of_samples(prompts, completions, width):
    """Next-token rows of ``prompt + completion`` sequences (right-padded to ``width + 1`` tokens)."""
    from jaxrl.models.scoring import next_token_inputs

    sequences = [np.concatenate([p, c]).astype(np.int32) for p, c in zip(prompts, completions, strict=True)]
    ids = np.zeros((len(sequences), width + 1), np.int32)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = s
    return next_token_inputs(ids, np.asarray([len(s) for s in sequences]))


def test_shared_prefix_layout_by_hand():
    """Prompt A (5 tokens) with completions of 3, 2 and 4 tokens, prompt B (3 tokens) with 2 and 3, a lone
    sample (prefix group -1): A's group shares its first 4 columns (inputs A0..A3 scoring A1..A4; column 4
    scores each completion's first token), B's its first 2. Widths: A 4 + 3 + 2 + 4 = 13, B 2 + 2 + 3 = 7,
    the lone sample 4; 24 of the samples' 34 columns. Rows of 16 (the candidates 16, 32, 64) hold them in
    two rows (A; B + lone) = 32 cells, fewer than 64 x 1."""
    a, b = np.arange(1, 6), np.arange(10, 13)
    prompts = [a, a, a, b, b, np.arange(20, 23)]
    completions = [[30, 31, 32], [33, 34], [35, 36, 37, 38], [40, 41], [42, 43, 44], [50, 51]]
    inputs = _groups_of_samples(prompts, completions, 16)
    packed = pack_rows(*inputs, prefix_groups=np.asarray([0, 0, 0, 1, 1, -1]))
    segments = np.asarray(packed.segment_ids)
    assert segments.shape == (2, 16) and packed.real_cells == 24 and (inputs[2] > 0).sum() == 34
    tail = lambda prefix, n: (1 << 30) + (prefix << 12) + n  # noqa: E731  (attention.tail_segment by hand)
    np.testing.assert_array_equal(segments[0], [1] * 4 + [tail(1, 1)] * 3 + [tail(1, 2)] * 2 + [tail(1, 3)] * 4
                                  + [0] * 3)
    np.testing.assert_array_equal(segments[1], [1] * 2 + [tail(1, 1)] * 2 + [tail(1, 2)] * 3 + [2] * 4 + [0] * 5)
    np.testing.assert_array_equal(np.asarray(packed.input_ids)[0, :13], [1, 2, 3, 4, 5, 30, 31, 5, 33, 5, 35, 36, 37])
    np.testing.assert_array_equal(np.asarray(packed.positions)[0, :13], [0, 1, 2, 3, 4, 5, 6, 4, 5, 4, 5, 6, 7])
    np.testing.assert_array_equal(np.asarray(packed.targets)[0, :13], [2, 3, 4, 5, 30, 31, 32, 33, 34, 35, 36, 37, 38])
    gather = np.asarray(packed.gather)
    np.testing.assert_array_equal(gather[1, :6], [0, 1, 2, 3, 7, 8])  # A's prefix, then its own tail
    np.testing.assert_array_equal(gather[4, :5], [16, 17, 20, 21, 22])  # B's prefix in row 1
    assert (gather[4, 5:] == 32).all()  # padding: out of range


def test_shared_prefix_splits_a_group_that_does_not_fit_a_row():
    """Four samples of one 9-token prompt, 7 new tokens each (15 columns; the prompt's first 8 shared):
    the whole group needs 8 + 4 x 7 = 36 columns. Rows of 16 hold one copy of the prompt with one tail
    (15 columns), rows of 32 a copy with three tails (29) and another with the last. The row lengths
    for T = 16 are 16 and 32, and 2 x 32 = 64 cells ties 4 x 16: the shorter rows win a tie."""
    from jaxrl.models.packing import _clusters, _items, _row_lengths

    prompt = np.arange(1, 10)
    inputs = _groups_of_samples([prompt] * 4, [np.arange(20, 27) + 10 * i for i in range(4)], 16)
    lengths, groups = (inputs[2] > 0).sum(axis=1), np.zeros(4, int)
    columns = [inputs[0], inputs[1], inputs[3]]
    (group,) = _clusters(np.arange(4), lengths, groups, columns)
    assert (group.shared, group.members) == (8, (0, 1, 2, 3))
    assert [(i.shared, i.members) for i in _items([group], lengths, 16)] == [(8, (0,)), (8, (1,)), (8, (2,)),
                                                                             (8, (3,))]
    assert [i.members for i in _items([group], lengths, 32)] == [(0, 1, 2), (3,)]
    assert _row_lengths(16) == [16, 32]
    packed = pack_rows(*inputs, prefix_groups=groups)
    assert np.shape(packed.segment_ids) == (4, 16) and packed.real_cells == 60


def test_shared_prefix_row_lengths_keep_the_length_multiple():
    """Four per octave up to twice the length; rounded up to the power of two dividing the length."""
    from jaxrl.models.packing import _row_lengths

    assert _row_lengths(47) == [47, 56, 67, 80, 94]  # 47 x 2^(j/4), rounded up to whole columns
    assert _row_lengths(96) == [96, 128, 160, 192]  # multiples of 32: 114.2 -> 128, 135.8 -> 160, 161.4 -> 192
    assert _row_lengths(4096) == [4096, 4992, 5888, 6912, 8192]  # multiples of 128


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_shared_prefix_logprobs_and_gradients_equal_one_sample_per_row(impl):
    """Groups sharing a prompt (one pair of samples also shares its first completion token, so more
    than the prompt), a lone sample: per-sample logprobs, entropy and the gradient of a loss over them
    equal one sample per row; the chunked kernel with blocks of 8 skips blocks of other tails."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    config = dataclasses.replace(CONFIG, attention_impl=impl, attention_block_size=8)
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(3)
    prompts, completions, groups = [], [], []
    for g, (p, n) in enumerate(((7, 4), (11, 3), (4, 2))):
        prompt = rng.integers(1, CONFIG.vocab_size, p)
        for _ in range(n):
            prompts.append(prompt)
            completions.append(rng.integers(1, CONFIG.vocab_size, rng.integers(2, 12)))
            groups.append(g)
    completions[1][:2] = completions[0][:2]
    prompts.append(rng.integers(1, CONFIG.vocab_size, 9))
    completions.append(rng.integers(1, CONFIG.vocab_size, 5))
    groups.append(-1)
    inputs = _groups_of_samples(prompts, completions, 24)
    packed = pack_rows(*inputs, prefix_groups=np.asarray(groups))
    assert packed.real_cells < (inputs[2] > 0).sum() - 2 * 6  # the prompts' copies are gone
    live = jnp.asarray(inputs[2] > 0)
    weights = jnp.asarray(rng.normal(size=inputs[0].shape), jnp.float32) * live

    def loss_and_outputs(params, rows, unpack):
        logp, entropy, _ = nnx.merge(graphdef, params).token_logprobs(*rows.model_inputs() if unpack else rows)
        logp, entropy = (unpack(x) if unpack else x for x in (logp, entropy))
        return jnp.sum(weights * (logp + 0.1 * entropy)), (logp, entropy)

    alone = jax.value_and_grad(lambda p: loss_and_outputs(p, inputs, None), has_aux=True)(params)
    shared = jax.value_and_grad(lambda p: loss_and_outputs(p, packed, packed.unpack), has_aux=True)(params)
    (loss_a, (logp_a, ent_a)), grad_a = alone
    (loss_s, (logp_s, ent_s)), grad_s = shared
    np.testing.assert_allclose(np.asarray(logp_s)[live], np.asarray(logp_a)[live], atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent_s)[live], np.asarray(ent_a)[live], atol=2e-5)
    np.testing.assert_allclose(float(loss_s), float(loss_a), rtol=1e-5)
    for a, s in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_s), strict=True):
        np.testing.assert_allclose(np.asarray(s), np.asarray(a), rtol=0, atol=1e-4 * float(np.max(np.abs(a))))


def test_shared_prefix_blockers_name_what_to_change():
    import dataclasses

    from jaxrl.models.packing import shared_prefix_blocker

    assert shared_prefix_blocker(CONFIG, "cpu") is None
    assert "splash" in shared_prefix_blocker(dataclasses.replace(CONFIG, attention_impl="auto"), "tpu")
    assert shared_prefix_blocker(dataclasses.replace(CONFIG, attention_impl="chunked"), "tpu") is None
    hybrid = dataclasses.replace(CONFIG, layer_types=("gated_deltanet", "full_attention"), linear_num_key_heads=2,
                                 linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    assert "['gated_deltanet'] layers carry a recurrent state" in shared_prefix_blocker(hybrid, "cpu")
