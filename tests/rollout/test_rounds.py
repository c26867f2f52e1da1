"""Long generations in rounds (jaxrl.rollout.rounds) against the one-call program and the learner's recompute.

The rounds path runs at small lengths here (round_tokens=16, 64 new tokens: three rounds) on 2 CPU
cores; bench/long_generation.py runs it at 8K-32K tokens."""

import numpy as np
import pytest
from scipy import special

from jaxrl.align.check import collect, score_with_learner
from jaxrl.align.metrics import build_report
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.rounds import round_schedule, row_bucket
from jaxrl.rollout.sampler import JaxSampler
from test_sampler import PROMPTS, full_forward, make_model

NEW = 64
# Stop ids with which the tiny model's 16 samples stop in every round (lengths 2 .. 59), one runs to the end.
STOPS = (3, 7)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=3, stop_token_ids=STOPS)


@pytest.fixture(scope="module")
def model():
    return make_model(max_position_embeddings=128)


@pytest.fixture(scope="module")
def generated(model):
    """{round_tokens: (samples [prompt][2], cache shapes)} for one call (0) and rounds of 16."""
    out = {}
    for round_tokens in (0, 16):
        sampler = JaxSampler(model, max_cache_len=128, max_batch=16, round_tokens=round_tokens)
        out[round_tokens] = sampler.generate(PROMPTS, PARAMS, n=2), sampler.cache_shapes
    return out


def test_round_schedule_doubles_the_cache_up_to_the_bucket():
    assert round_schedule(64, 16) == [(0, 16), (16, 32), (32, 64)]
    assert round_schedule(64, 12) == [(0, 16), (16, 32), (32, 64)]  # rounded up to a power of two
    assert round_schedule(16, 16) == [(0, 16)] and round_schedule(64, 0) == [(0, 64)]
    assert [row_bucket(n) for n in range(1, 17)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16]


def test_rounds_sample_what_one_call_samples_with_fewer_rows(generated):
    (one_call, one_shapes), (rounds, round_shapes) = generated[0], generated[16]
    assert one_shapes == [(16, 16 + NEW)]
    # Round 0 holds every row with 16 new-token rows, later rounds only the unfinished ones.
    assert round_shapes[0] == (16, 32) and [c for _, c in round_shapes] == [32, 48, 80][:len(round_shapes)]
    assert round_shapes == [(16, 32), (12, 48), (6, 80)]  # 10 rows go on after round 0, 6 after round 1
    lengths = []
    for group_a, group_b in zip(one_call, rounds, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
            assert a.finish_reason == b.finish_reason
            np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, rtol=0, atol=5e-6)
            lengths.append(b.output_ids.size)
    # rows stopped in each round, and some ran to the end
    assert min(lengths) < 16 and any(16 <= n < 32 for n in lengths) and any(32 <= n < NEW for n in lengths)
    assert NEW in lengths


def test_rounds_logprobs_match_the_learner_recompute(model):
    sampler = JaxSampler(model, max_cache_len=128, max_batch=16, round_tokens=16)
    batch = score_with_learner(model, collect(sampler, PROMPTS, PARAMS))
    assert len(sampler.cache_shapes) == 3
    overall = build_report(batch)["overall"]
    assert overall["num_tokens"] > 3 * 16
    assert overall["abs_log_ratio_max"] < 5e-6 and overall["k3"] < 1e-11


def test_moe_routes_of_later_rounds_are_the_full_forward_routes():
    moe = make_model(num_layers=1, mlp_types=("moe",), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     max_position_embeddings=64)
    sampler = JaxSampler(moe, max_cache_len=64, max_batch=8, round_tokens=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=1)
    out = [s for (s,) in sampler.generate(PROMPTS, params)]
    assert len(sampler.cache_shapes) == 3
    logits, routes = full_forward(moe, [p + s.output_ids.tolist() for p, s in zip(PROMPTS, out, strict=True)],
                                  width=32)
    for prompt, sample, row_logits, route in zip(PROMPTS, out, logits, routes, strict=True):
        assert sample.output_ids.size == 24
        span = slice(len(prompt) - 1, len(prompt) + 23)  # output token j is predicted from position len(prompt)-1+j
        np.testing.assert_array_equal(sample.routed_experts, route[span])
        np.testing.assert_array_equal(sample.prompt_routed_experts, route[:len(prompt) - 1])
        expected = special.log_softmax(row_logits[span].astype(np.float64), axis=-1)[np.arange(24), sample.output_ids]
        np.testing.assert_allclose(sample.output_logprobs, expected, atol=5e-5, rtol=5e-5)


def test_round_tokens_must_not_be_negative(model):
    with pytest.raises(ValueError, match="round_tokens must be >= 0"):
        JaxSampler(model, round_tokens=-1)
