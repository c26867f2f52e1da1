"""The embedded sampler's KV cache kept between model turns (jaxrl.rollout.turn_cache): a turn
continued from it samples what a fresh read of the whole conversation samples, with the same
logprobs up to float32 rounding; anything it cannot serve is read afresh."""

import numpy as np
from flax import nnx

from jaxrl.env import Environment, EnvLimits, StepResult, run_episodes
from jaxrl.models import Decoder, ModelConfig
from jaxrl.models.scoring import sequence_logprobs
from jaxrl.rollout.base import Conversation, SamplingParams
from jaxrl.rollout.sampler import JaxSampler

DENSE = ModelConfig(vocab_size=17, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=16, max_position_embeddings=256)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(1,), seed=5)


class EchoLengthEnv(Environment):
    """Answers each model turn with 1..5 tokens (by the turn's length), so the rows of a batch
    append chunks of different lengths and the kept cache gets empty rows between turns."""

    def __init__(self):
        self.limits = EnvLimits(max_turns=4, max_total_tokens=150)

    def reset(self, row):
        return Conversation.from_prompt(row["ids"])

    def step(self, conversation, model_turn):
        return StepResult(observation_ids=[3 + (len(model_turn) + i) % 9 for i in range(1 + len(model_turn) % 5)])


def play(engine, rows):
    return run_episodes(engine, [EchoLengthEnv() for _ in rows], rows, PARAMS).conversations


ROWS = [{"ids": [2 + i % 7, 9, 4 + i % 5, 11][: 2 + i % 3]} for i in range(12)]


def test_continued_turns_sample_what_a_fresh_read_samples():
    model = Decoder(DENSE, rngs=nnx.Rngs(0))
    kept, fresh = JaxSampler(model, max_batch=16), JaxSampler(model, max_batch=16, keep_turns=False)
    with_cache, without = play(kept, ROWS), play(fresh, ROWS)
    assert kept.turn_calls == {"continued": 3, "fresh": 1}
    # The case the layout must handle: turns that stopped early and chunks of several lengths.
    assert any("stop" in c.finish_reasons[:-1] for c in with_cache)
    assert len({len(c.token_ids) for c in with_cache}) > 3
    for a, b in zip(with_cache, without, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.model_mask, b.model_mask)
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5)
    pairs = zip(with_cache, without, strict=True)
    gap = max(float(np.abs(a.rollout_logprobs - b.rollout_logprobs).max()) for a, b in pairs)
    print(f"max |logprob kept cache - fresh read| {gap:.2g}")
    # And the learner's recompute of the whole conversations agrees on every model token.
    lengths = np.array([len(c.token_ids) for c in with_cache])
    tokens = np.zeros((len(with_cache), lengths.max()), np.int32)
    for r, c in enumerate(with_cache):
        tokens[r, :lengths[r]] = c.token_ids
    learner = sequence_logprobs(model, tokens, lengths)
    for r, c in enumerate(with_cache):
        model_tokens = c.model_mask == 1
        np.testing.assert_allclose(learner[r, :lengths[r]][model_tokens], c.rollout_logprobs[model_tokens], atol=1e-4)
    assert kept._turns is None  # run_episodes ended the conversations: the cache is freed


def test_a_weight_push_or_an_unknown_conversation_reads_afresh():
    model = Decoder(DENSE, rngs=nnx.Rngs(0))
    engine = JaxSampler(model, max_batch=8)
    first = engine.continue_conversations([Conversation.from_prompt([2, 5, 7])], PARAMS)[0]
    second = engine.continue_conversations([first.add_environment_tokens([3, 4])], PARAMS)[0]
    assert engine.turn_calls == {"continued": 1, "fresh": 1}
    engine.update_weights(nnx.state(model), version="1")  # the kept keys and values are stale now
    engine.continue_conversations([second.add_environment_tokens([3])], PARAMS)
    assert engine.turn_calls == {"continued": 1, "fresh": 2}
    # A conversation the cache never held (another prompt) is read afresh, and so is one with no
    # new token since its model turn.
    other = engine.continue_conversations([Conversation.from_prompt([6, 6])], PARAMS)[0]
    engine.continue_conversations([other], PARAMS)
    assert engine.turn_calls == {"continued": 1, "fresh": 4}


def test_moe_routes_of_continued_turns_are_a_fresh_reads():
    """A MoE model continues from the kept cache too: every position's route in the conversations
    (the earlier turns', the last token of each turn, kept from its decode step, and the new
    tokens') equals what reading every turn afresh records."""
    model = Decoder(DENSE.replace(mlp_types=("moe", "dense"), num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16), rngs=nnx.Rngs(0))
    kept, fresh = JaxSampler(model, max_batch=16), JaxSampler(model, max_batch=16, keep_turns=False)
    with_cache, without = play(kept, ROWS[:8]), play(fresh, ROWS[:8])
    assert kept.turn_calls["continued"] == 3
    for a, b in zip(with_cache, without, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5)
        assert a.routed_experts.shape == (len(a.token_ids) - 1, 1, 2)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_linear_attention_models_read_every_turn_afresh():
    model = Decoder(DENSE.replace(layer_types=("gated_deltanet", "full_attention"), linear_num_key_heads=1,
                                  linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                  linear_chunk_size=4), rngs=nnx.Rngs(0))
    engine = JaxSampler(model, max_batch=16)
    assert not engine.keep_turns
    conversations = play(engine, ROWS[:4])
    assert all(c.num_model_turns >= 1 for c in conversations) and engine.turn_calls == {"continued": 0, "fresh": 0}
