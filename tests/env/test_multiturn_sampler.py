"""A multi-turn batch through the embedded sampler and through a real CPU SGLang server: the
learner's recompute equals the engine's logprobs on every model token, across turns (the float32
decode residual of the embedded sampler, docs/rollouts.md; 1e-5 for SGLang, as single-turn)."""

import numpy as np
import pytest
from flax import nnx

from jaxrl.env import EnvLimits, run_episodes
from jaxrl.models import Decoder, ModelConfig
from jaxrl.models.scoring import sequence_logprobs
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.sampler import JaxSampler
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON

from test_driver import CountingEnv


def _worst_gap_on_model_tokens(model, engine) -> float:
    """Three-turn conversations of 8 rows with a fixed observation between turns, played by
    ``engine``: the largest |learner recompute - engine logprob| over every model token."""
    rows = [{"ids": [2 + i % 7, 9, 4 + i % 5]} for i in range(8)]
    envs = [CountingEnv(EnvLimits(max_turns=3, max_total_tokens=100)) for _ in rows]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(1,), seed=3)
    batch = run_episodes(engine, envs, rows, params)
    conversations = batch.conversations
    assert all(c.num_model_turns == 3 for c in conversations) and batch.metrics["env/finished_max_turns"] == 1.0
    lengths = np.array([len(c.token_ids) for c in conversations])
    tokens = np.zeros((len(conversations), lengths.max()), np.int32)
    for b, c in enumerate(conversations):
        tokens[b, :lengths[b]] = c.token_ids
    learner = sequence_logprobs(model, tokens, lengths)
    worst = 0.0
    for b, c in enumerate(conversations):
        model_tokens = c.model_mask == 1
        assert model_tokens.sum() > 0
        gap = np.abs(learner[b, :lengths[b]][model_tokens] - c.rollout_logprobs[model_tokens])
        worst = max(worst, float(gap.max()))
    return worst


def test_learner_recompute_matches_engine_logprobs_across_turns():
    config = ModelConfig(vocab_size=17, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=128)
    model = Decoder(config, rngs=nnx.Rngs(0))
    worst = _worst_gap_on_model_tokens(model, JaxSampler(model, max_batch=8))
    assert worst < 1e-4, f"max |learner - engine| logprob on model tokens = {worst:.2e}"


@pytest.mark.sglang
@pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first")
def test_sglang_multiturn_logprobs_match_the_learner_across_turns(sglang_dense):
    """The same conversations on the real SGLang server (it continues each from its token ids)."""
    worst = _worst_gap_on_model_tokens(sglang_dense.model, sglang_dense.engine)
    assert worst < 1e-5, f"max |learner - SGLang| logprob on model tokens = {worst:.2e}"
