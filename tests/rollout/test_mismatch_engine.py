"""The engine-side mismatch injections (jaxrl.rollout.mismatch): each engine samples from the
weights it says it holds, and its logprobs differ from the learner's by the injected amount."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.scoring import sequence_logprobs
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.mismatch import MismatchEngine, perturb

TINY = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, max_position_embeddings=32)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
PARAMS = SamplingParams(max_new_tokens=6, seed=3)


def make_model(seed=0):
    model = Decoder(ModelConfig(**TINY), rngs=nnx.Rngs(seed))
    # A larger init scale than 0.02 gives peaked next-token distributions, so logprobs move visibly.
    nnx.update(model, jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, nnx.state(model)))
    return model


def engine_vs(model, engine):
    """(engine logprobs, ``model``'s logprobs of the same tokens), flattened over real tokens."""
    samples = [s for group in engine.generate(PROMPTS, PARAMS, n=2) for s in group]
    rows = [np.concatenate([s.prompt_ids, s.output_ids]) for s in samples]
    width = max(map(len, rows))
    ids = np.stack([np.pad(r, (0, width - len(r))) for r in rows]).astype(np.int32)
    lengths = np.array([len(r) for r in rows], np.int32)
    learner = sequence_logprobs(model, ids, lengths)
    ours = [learner[i, len(s.prompt_ids):len(s.prompt_ids) + len(s.output_ids)] for i, s in enumerate(samples)]
    return np.concatenate([s.output_logprobs for s in samples]), np.concatenate(ours)


def test_stale_engine_samples_from_the_weights_k_pushes_ago():
    models = [make_model(seed) for seed in range(4)]
    engine = MismatchEngine(models[0], "stale", steps=2, max_batch=8)
    for version, model in enumerate(models[1:], 1):
        engine.update_weights(model, str(version))
    # After pushes 1, 2, 3 the engine holds version 1 (two pushes behind) and says so.
    assert engine.weight_version == "1"
    got, stale = engine_vs(models[1], engine)
    np.testing.assert_allclose(got, stale, atol=2e-4)
    _, newest = engine_vs(models[3], engine)
    assert np.abs(got - newest).mean() > 0.1


def test_stale_engine_keeps_its_copy_after_the_learner_arrays_are_deleted():
    first, second = make_model(0), make_model(1)
    expected = engine_vs(first, MismatchEngine(first, "stale", steps=1, max_batch=8))[1]
    engine = MismatchEngine(first, "stale", steps=1, max_batch=8)
    engine.update_weights(second, "1")
    for leaf in jax.tree.leaves(nnx.state(first)):
        leaf.delete()  # what the donating train step does to the learner's arrays
    got = np.concatenate([s.output_logprobs for g in engine.generate(PROMPTS, PARAMS, n=2) for s in g])
    np.testing.assert_allclose(got, expected, atol=2e-4)


def test_noise_engine_differs_by_its_scale_and_is_deterministic():
    model = make_model()
    small = engine_vs(model, MismatchEngine(model, "noise", scale=0.01, max_batch=8))
    large = engine_vs(model, MismatchEngine(model, "noise", scale=0.1, max_batch=8))
    gap_small, gap_large = (np.abs(a - b).mean() for a, b in (small, large))
    assert 1e-4 < gap_small < gap_large  # larger noise, larger mismatch
    state = nnx.state(model)
    for a, b in zip(jax.tree.leaves(perturb(state, 0.1, seed=5)), jax.tree.leaves(perturb(state, 0.1, seed=5)),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_bf16_engine_differs_from_float32_by_a_bf16_sized_amount():
    model = make_model()
    engine = MismatchEngine(model, "bf16", max_batch=8)
    assert {leaf.dtype for leaf in jax.tree.leaves(engine.engine.state)} == {np.dtype("bfloat16")}
    got, learner = engine_vs(model, engine)
    gap = np.abs(got - learner).mean()
    # bfloat16 keeps 8 mantissa bits (relative error ~4e-3 per weight and matmul input): logprobs move by
    # about 1e-3..1e-1 on this peaked model, far above float32's decode residual (~1e-6).
    assert 1e-4 < gap < 0.3, gap
    engine.update_weights(model, "1")
    assert engine.weight_version == "1"


def test_rejects_unknown_kinds_and_bad_settings():
    model = make_model()
    for kind, options in (("fp8", {}), ("stale", {"steps": 0}), ("noise", {"scale": 0.0})):
        with pytest.raises(ValueError, match="MismatchEngine"):
            MismatchEngine(model, kind, **options)
