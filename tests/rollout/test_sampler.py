"""The embedded JAX sampler against the learner's full forward and closed-form distributions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import special, stats

from jaxrl.align.check import collect, score_with_learner
from jaxrl.align.metrics import build_report
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.rollout.base import Conversation, LogprobKind, SamplingParams
from jaxrl.rollout.sampler import JaxSampler, processed_logits, sample_step

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, max_position_embeddings=128)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21, 22], [23, 24, 25],
           [26, 27, 28, 29, 30, 31]]


def make_model(seed=0, **overrides):
    # A larger init scale than transformers' 0.02 gives peaked, varied next-token distributions.
    model = Decoder(ModelConfig(**(TINY | overrides)), rngs=nnx.Rngs(seed))
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, state))
    return model


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def sampler(model):
    return JaxSampler(model, max_cache_len=64, max_batch=8)


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(graphdef, state, ids, lengths):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    segments = (positions < lengths[:, None]).astype(jnp.int32)
    out = model(ids, positions, segments)
    return model.head(out.hidden), out.routed_experts


def full_forward(model, sequences, width=16):
    """The learner's full forward over right-padded sequences: (logits [B, W, V], routes or None)."""
    ids = np.zeros((len(sequences), width), np.int32)
    for r, seq in enumerate(sequences):
        ids[r, :len(seq)] = seq
    graphdef, state = nnx.split(model)
    logits, routes = _forward(graphdef, state, jnp.asarray(ids), jnp.asarray([len(s) for s in sequences]))
    return np.asarray(logits), None if routes is None else np.asarray(routes)


def full_logits(model, sequences):
    return full_forward(model, sequences)[0]


def test_greedy_equals_argmax_of_the_full_forward_step_by_step(model, sampler):
    out = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    checked = 0
    all_logits = full_logits(model, [p + s.output_ids.tolist() for p, (s,) in zip(PROMPTS, out, strict=True)])
    for prompt, (sample,), logits in zip(PROMPTS, out, all_logits, strict=True):
        assert sample.output_ids.size == 8 and sample.finish_reason == "length"
        for step, token in enumerate(sample.output_ids):
            row = logits[len(prompt) - 1 + step]
            top2 = np.sort(row)[-2:]
            assert top2[1] - top2[0] > 1e-4, "near tie: the test would not be meaningful"
            assert token == np.argmax(row), (prompt, step)
            checked += 1
    assert checked == 64


def test_sample_step_follows_the_processed_distribution_chi_squared():
    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]])
    n = 20000
    keys = jax.random.split(jax.random.PRNGKey(123), n)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (1.0, 6, 0.9)]:
        def draw(k, temperature=temperature, top_k=top_k, top_p=top_p):  # this iteration's settings, bound now
            return sample_step(logits, k[None], temperature, top_k, top_p)

        tokens, _, proc = jax.vmap(draw)(keys)
        tokens = np.asarray(tokens)[:, 0]
        # expected: softmax(logits / T) restricted to the hand-derived support, renormalised
        scaled = np.asarray(logits[0], np.float64) / temperature
        order = np.argsort(-scaled, kind="stable")
        support = order[:top_k] if top_k else order
        p = np.exp(scaled[support] - scaled[support].max())
        p /= p.sum()
        if top_p < 1:
            keep = (np.cumsum(p) - p) < top_p
            support, p = support[keep], p[keep] / p[keep].sum()
        counts = np.bincount(tokens, minlength=8)
        assert counts[np.setdiff1d(np.arange(8), support)].sum() == 0, (temperature, top_k, top_p)
        chi2, pvalue = stats.chisquare(counts[support], n * p)
        assert pvalue > 1e-3, (temperature, top_k, top_p, chi2, pvalue)
        # processed logprob returned is log p of the drawn token under that distribution
        lookup = dict(zip(support.tolist(), np.log(p), strict=True))
        np.testing.assert_allclose(np.asarray(proc)[:50, 0], [lookup[t] for t in tokens[:50]], rtol=1e-5)


def test_sampler_first_tokens_follow_the_model_distribution(model, sampler):
    prompt = [3, 1, 4, 1, 5]
    n = 2048
    # max_new_tokens=8 reuses the compiled bucket of the other tests; only first tokens are tested
    out = sampler.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=8, seed=7), n=n)
    tokens = np.array([s.output_ids[0] for s in out[0]])
    logits = full_logits(model, [prompt])[0, len(prompt) - 1].astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    # pool the rare tokens so every cell expects >= 5 draws
    order = np.argsort(-p)
    common = order[n * p[order] >= 5]
    observed = np.append(np.bincount(tokens, minlength=64)[common], np.isin(tokens, common, invert=True).sum())
    expected = np.append(n * p[common], n * (1 - p[common].sum()))
    assert len(common) >= 8
    _, pvalue = stats.chisquare(observed, expected)
    assert pvalue > 1e-3, pvalue


def test_top_k_and_top_p_mask_exactly_the_right_tokens():
    logp = np.log(np.array([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]], np.float32))
    jitted = jax.jit(processed_logits)
    kept = lambda **kw: np.isfinite(np.asarray(jitted(jnp.asarray(logp), **kw)))[0].nonzero()[0].tolist()
    assert kept(temperature=1.0, top_k=0, top_p=1.0) == [0, 1, 2, 3]
    assert kept(temperature=1.0, top_k=2, top_p=1.0) == [1, 3]
    assert kept(temperature=1.0, top_k=1, top_p=1.0) == [1]
    assert kept(temperature=1.0, top_k=0, top_p=0.65) == [1, 3]  # 0.4, then mass 0.4 < 0.65 keeps 0.3
    assert kept(temperature=1.0, top_k=0, top_p=0.35) == [1]
    assert kept(temperature=1.0, top_k=0, top_p=0.75) == [1, 2, 3]  # mass before 0.2 is 0.7 < 0.75
    # top-p acts on the top-k renormalised distribution: top-3 -> [0.444, 0.333, 0.222]
    assert kept(temperature=1.0, top_k=3, top_p=0.5) == [1, 3]
    assert kept(temperature=1.0, top_k=3, top_p=0.4) == [1]
    # temperature sharpens before top-p: T=0.5 -> probs prop. to p^2 = [.01,.16,.04,.09]/.30
    assert kept(temperature=0.5, top_k=0, top_p=0.6) == [1, 3]  # 0.533 < 0.6 keeps 0.3
    # ties at the top-k boundary go to the lower token id
    tie = jnp.asarray([[0.0, 2.0, 2.0, 1.0]])
    assert np.isfinite(np.asarray(jitted(tie, 1.0, 1, 1.0)))[0].nonzero()[0].tolist() == [1]
    assert np.isfinite(np.asarray(jitted(tie, 1.0, 2, 1.0)))[0].nonzero()[0].tolist() == [1, 2]


def test_top_k_top_p_support_equals_a_stable_argsort_reference_with_many_ties():
    """The sampler sorts values only (no permutation); the support must still be the first n tokens
    of a stable descending argsort (lower id first on ties), checked on logits with heavy ties and
    negative values, against numpy."""
    rng = np.random.default_rng(7)
    logits = np.round(rng.normal(size=(6, 40)) * 2) / 2  # steps of 0.5: many ties, signs mixed
    logits[0] = 0.0  # one row all tied
    logits = logits.astype(np.float32)
    jitted = jax.jit(processed_logits)
    for temperature, top_k, top_p in [(1.0, 5, 1.0), (0.7, 0, 0.5), (1.3, 12, 0.8), (1.0, 1, 0.3), (1.0, 40, 0.99),
                                      (1.0, 0, 1.0), (0.9, 3, 0.05)]:
        got = np.isfinite(np.asarray(jitted(jnp.asarray(logits), temperature, top_k, top_p)))
        for row, want_logits in zip(got, logits / np.float32(temperature), strict=True):
            order = np.argsort(-want_logits, kind="stable")
            k = top_k if top_k > 0 else len(order)
            probs = np.exp(want_logits[order[:k]] - want_logits[order[0]])
            probs /= probs.sum()
            before = np.cumsum(probs) - probs
            n = int(np.sum(before < top_p)) if top_p < 1 else k
            assert sorted(row.nonzero()[0].tolist()) == sorted(order[:max(n, 1)].tolist()), (temperature, top_k, top_p)


def test_sampled_tokens_stay_in_the_top_k_of_the_full_forward(model, sampler):
    prompts = PROMPTS
    out = sampler.generate(prompts, SamplingParams(temperature=1.0, top_k=3, max_new_tokens=8, seed=3))
    all_logits = full_logits(model, [p + s.output_ids.tolist() for p, (s,) in zip(prompts, out, strict=True)])
    for prompt, (sample,), logits in zip(prompts, out, all_logits, strict=True):
        for step, token in enumerate(sample.output_ids):
            top3 = np.argsort(-logits[len(prompt) - 1 + step], kind="stable")[:3]
            assert token in top3


def test_stop_ids_end_a_sample_and_mask_what_follows(model, sampler):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    first = sampler.generate(PROMPTS, greedy)
    stop = int(first[0][0].output_ids[2])
    out = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))
    for (full,), (cut,) in zip(first, out, strict=True):
        hits = np.flatnonzero(full.output_ids == stop)
        if hits.size:
            assert cut.finish_reason == "stop" and cut.output_ids.size == hits[0] + 1
            assert cut.output_ids[-1] == stop
        else:
            assert cut.finish_reason == "length" and cut.output_ids.size == 8
        np.testing.assert_array_equal(cut.output_ids, full.output_ids[:cut.output_ids.size])
        np.testing.assert_array_equal(cut.output_logprobs, full.output_logprobs[:cut.output_ids.size])
    # the conversation built from a stopped sample marks exactly its tokens as model tokens
    conv = Conversation.from_prompt(PROMPTS[0]).add_model_turn(out[0][0])
    assert conv.model_mask.sum() == 3 and conv.model_mask[-3:].all()


def test_seeds_are_per_sample_and_independent_of_the_batch(sampler):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)
    mine = sampler.generate(PROMPTS[:4], params, n=2)
    # same prompt index, different companions / padding rows: same samples
    other_companions = sampler.generate(PROMPTS[:2] + PROMPTS[5:7], params, n=2)
    padded = sampler.generate(PROMPTS[:3], params, n=2)
    for i in range(2):
        for j in range(2):
            np.testing.assert_array_equal(mine[i][j].output_ids, other_companions[i][j].output_ids)
            np.testing.assert_array_equal(mine[i][j].output_ids, padded[i][j].output_ids)
    assert not np.array_equal(mine[1][0].output_ids, mine[1][1].output_ids)
    reseeded = sampler.generate(PROMPTS[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=12), n=2)
    assert any(not np.array_equal(a.output_ids, b.output_ids) for a, b in zip(mine[1], reseeded[1], strict=True))


def test_processed_logprobs_are_the_filtered_distribution(model, sampler):
    params = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=8, seed=5, logprob_kind="processed")
    (sample,), *_ = sampler.generate(PROMPTS, params)
    assert sample.logprob_kind == LogprobKind.PROCESSED
    logits = full_logits(model, [PROMPTS[0] + sample.output_ids.tolist()])[0]
    for step, token in enumerate(sample.output_ids):
        row = logits[len(PROMPTS[0]) - 1 + step].astype(np.float64) / 0.8
        top = np.argsort(-row, kind="stable")[:5]
        expected = row[token] - np.log(np.sum(np.exp(row[top])))
        assert sample.output_logprobs[step] == pytest.approx(expected, abs=1e-5)


def test_float32_recompute_residual(model, sampler):
    """Learner recompute vs the sampler's RAW logprobs in float32 (see sampler module doc).

    Not bit-identical on XLA CPU (shape-dependent matmul tiling); the residual is float32
    rounding of the logits: measured max |dlogp| ~1.4e-6, k3 ~2e-13 (jax 0.10.2, XLA CPU).
    """
    batch = score_with_learner(model, collect(sampler, PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8,
                                                                               seed=1)))
    overall = build_report(batch)["overall"]
    identical = batch.learner_logprobs[batch.model_mask] == batch.rollout_logprobs[batch.model_mask]
    print(f"\nfloat32 recompute: max|dlogp| {overall['abs_log_ratio_max']:.3g}  k3 {overall['k3']:.3g}  "
          f"identical tokens {np.mean(identical):.3f}")
    assert overall["abs_log_ratio_max"] < 5e-6
    assert overall["k3"] < 1e-11


def test_yarn_recompute_residual_past_the_window(model):
    """With YaRN (docs/models.md#rope-scaling) the sampler's prefill and decode steps rotate with the learner's
    tables: its raw logprobs equal the learner's recompute at float32 rounding on tokens up to position 30,
    past an 8-position window; the same weights with plain RoPE (`model`) score them otherwise."""
    yarn = make_model(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8})
    batch = collect(JaxSampler(yarn, max_cache_len=64, max_batch=8), PROMPTS,
                    SamplingParams(temperature=1.0, max_new_tokens=24, seed=1))
    overall = build_report(score_with_learner(yarn, batch))["overall"]
    assert overall["num_tokens"] == len(PROMPTS) * 24 and overall["abs_log_ratio_max"] < 5e-6
    assert build_report(score_with_learner(model, batch))["overall"]["abs_log_ratio_max"] > 1e-2


def test_bfloat16_sampler_and_learner_agree_within_the_push_checks_mean(model):
    """bfloat16 compute (float32 weights): the sampler's raw logprobs against the learner's
    recompute. Both round to bfloat16 at the same points, so the gaps are float32 sums in another
    order, now and then flipping a bfloat16 rounding: over six seeds of a 4-layer model
    (bench/bf16_logprob_gap.py) the mean |dlogp| stayed under 2.6e-3 while the largest reached
    0.052. The bound on the mean is twice that figure, well inside the push check's default on the
    mean (0.05, rollout.push_check: auto in bfloat16); a model of other weights is over 1 nat off."""
    from jaxrl.trainer.stages.push import DEFAULT_TOLERANCE

    bf16 = make_model(dtype="bfloat16")
    batch = collect(JaxSampler(bf16, max_cache_len=64, max_batch=8), PROMPTS,
                    SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    same = build_report(score_with_learner(bf16, batch))["overall"]
    other = build_report(score_with_learner(make_model(seed=1, dtype="bfloat16"), batch))["overall"]
    print(f"\nbfloat16 compute: mean |dlogp| {same['abs_log_ratio_mean']:.3g}, max {same['abs_log_ratio_max']:.3g}; "
          f"other weights: mean {other['abs_log_ratio_mean']:.3g}")
    assert same["num_tokens"] == 64
    assert same["abs_log_ratio_mean"] <= 5e-3 < DEFAULT_TOLERANCE["mean"] < 1.0 < other["abs_log_ratio_mean"]


def test_update_weights_reads_the_learner_arrays_without_copy(model):
    learner = make_model(seed=1)
    sampler = JaxSampler(learner, max_cache_len=64, max_batch=8)
    state = nnx.state(learner)
    for mine, theirs in zip(jax.tree.leaves(sampler.state), jax.tree.leaves(state), strict=True):
        assert mine is theirs
    before = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    sampler.update_weights(nnx.state(model), "v2")
    assert sampler.weight_version == "v2"
    after = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert after[0][0].weight_version == "v2"
    assert any(not np.array_equal(a[0].output_ids, b[0].output_ids) for a, b in zip(before, after, strict=True))
    wrong = jax.tree.map(lambda x: x[..., :1] if x.ndim == 1 else x, nnx.state(model))
    with pytest.raises(ValueError, match="final_norm.*has shape"):
        sampler.update_weights(wrong, "v3")
    # a donating train step deletes the arrays the sampler references: say so, do not crash later
    donated = jax.tree.map(lambda x: x + 0, nnx.state(model))
    sampler.update_weights(donated, "v4")
    jax.tree.leaves(donated)[0].delete()
    with pytest.raises(RuntimeError, match="weights \\(version 'v4'\\) were deleted"):
        sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))


def test_a_request_that_exactly_fills_the_cache(model):
    # 14 prompt tokens + 10 new = 24 = max_cache_len: the power-of-two prompt bucket (16) would
    # push decode past the cache, so the sampler must shrink it.
    prompt = list(range(1, 15))
    small = JaxSampler(model, max_cache_len=24, max_batch=8)
    (sample,), = small.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=10))
    logits = full_forward(model, [prompt + sample.output_ids.tolist()], width=24)[0][0]
    np.testing.assert_array_equal(sample.output_ids, np.argmax(logits[13:23], axis=-1))
    expected = special.log_softmax(logits[13:23].astype(np.float64), axis=-1)[np.arange(10), sample.output_ids]
    np.testing.assert_allclose(sample.output_logprobs, expected, atol=1e-5)  # an overrun cache corrupts the last steps


def test_prompt_longer_than_the_cache_names_the_prompt(sampler):
    with pytest.raises(ValueError, match="prompt 1 has 60 tokens; with max_new_tokens=8 it needs 68 cache rows"):
        sampler.generate([[1, 2], list(range(60))], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match=r"prompt 0: token ids must be in \[0, 64\)"):
        sampler.generate([[1, 99]], SamplingParams())


def test_moe_routed_experts_match_the_full_forward():
    moe = make_model(num_layers=1, mlp_types=("moe",), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    sampler = JaxSampler(moe, max_cache_len=64, max_batch=8)
    # Two samples per prompt at temperature 1: different continuations of one shared prefill.
    out = sampler.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1), n=2)
    pairs = [(p, s) for p, group in zip(PROMPTS, out, strict=True) for s in group]
    _, routes = full_forward(moe, [p + s.output_ids.tolist() for p, s in pairs])
    assert any(not np.array_equal(a.output_ids, b.output_ids) for a, b in out)
    for (prompt, sample), route in zip(pairs, routes, strict=True):
        assert sample.routed_experts.shape == (8, 1, 2)
        # output token j is predicted from input position len(prompt) - 1 + j
        np.testing.assert_array_equal(sample.routed_experts, route[len(prompt) - 1:len(prompt) + 7])
        # the prefill's routes of prompt positions 0..P-2 (left-padded there, not here)
        assert sample.prompt_routed_experts.shape == (len(prompt) - 1, 1, 2)
        np.testing.assert_array_equal(sample.prompt_routed_experts, route[:len(prompt) - 1])


def test_generate_without_a_kept_cache_samples_what_the_kept_cache_path_samples(model, sampler):
    """A plain generate does not feed its last sampled token (nothing reads that cache row); the
    kept-cache path of multi-turn feeds every token. Both give the same samples, also when rows stop
    early (a stop id) and when one token is asked for (no token is fed at all), and every logprob of
    the plain path, the unfed last token's too, is the learner's full forward's (temperature 1)."""
    arrays = [np.asarray(p, np.int32) for p in PROMPTS]
    jobs = [(i, j) for i in range(len(arrays)) for j in range(2)][:8]  # two samples of each of four prompts
    rows = [arrays[i] for i, _ in jobs]
    seeded = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    stop = int(sampler._run(rows, jobs, seeded)[0][0].output_ids[2])
    for params in (seeded, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5, stop_token_ids=(stop,)),
                   SamplingParams(temperature=1.0, max_new_tokens=1, seed=5)):
        plain, kept = (sampler._run(rows, jobs, params, keep_cache=keep)[0]
                       for keep in (False, True))
        assert [s.output_ids.size for s in plain] == [s.output_ids.size for s in kept]
        for a, b in zip(plain, kept, strict=True):
            np.testing.assert_array_equal(a.output_ids, b.output_ids)
            np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-6)
            assert a.finish_reason == b.finish_reason
        logits = full_logits(model, [r.tolist() + s.output_ids.tolist() for r, s in zip(rows, plain, strict=True)])
        for r, (prompt, s) in enumerate(zip(rows, plain, strict=True)):
            steps = logits[r, prompt.size - 1:prompt.size - 1 + s.output_ids.size].astype(np.float64)
            expected = special.log_softmax(steps, axis=-1)[np.arange(s.output_ids.size), s.output_ids]
            np.testing.assert_allclose(s.output_logprobs, expected, atol=5e-5)
        if params.stop_token_ids:
            assert {s.finish_reason for s in plain} == {"stop", "length"}


def test_sharded_sampler_matches_one_device(model, sampler):
    from jaxrl.models.sharding import MeshConfig, make_mesh, shard_model

    mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    sharded, _ = shard_model(model, mesh)
    on_mesh = JaxSampler(sharded, max_cache_len=64, max_batch=8, mesh=mesh)
    assert jax.tree.leaves(on_mesh.state)[0].sharding.mesh.shape == mesh.shape
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for (a,), (b,) in zip(sampler.generate(PROMPTS, params), on_mesh.generate(PROMPTS, params), strict=True):
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=5e-6)


def test_multi_turn_conversations_and_per_turn_report(model, sampler):
    from jaxrl.align import AlignmentBatch

    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=2, stop_token_ids=(7,))
    conversations = [Conversation.from_prompt(p[:5]) for p in PROMPTS]
    conversations = sampler.continue_conversations(conversations, params)
    conversations = [c.add_environment_tokens([60, 61]) for c in conversations]
    conversations = sampler.continue_conversations(conversations, params)
    for c in conversations:
        assert c.num_model_turns == 2
        assert (c.model_mask[c.turn_ids >= 0] == 1).all() and (c.turn_ids[c.model_mask == 0] == -1).all()
    batch = score_with_learner(model, AlignmentBatch.from_conversations(conversations))
    report = build_report(batch)
    assert report["turns"]["first"]["num_tokens"] + report["turns"]["later"]["num_tokens"] == batch.model_mask.sum()
    assert report["turns"]["later"]["num_tokens"] > 0
    assert report["overall"]["abs_log_ratio_max"] < 5e-6


def test_hybrid_linear_attention_greedy_and_recompute():
    # Left-padded prefill keeps the recurrent states exact for prompts of different lengths.
    hybrid = make_model(num_layers=3, layer_types=("lightning_attention", "gated_deltanet", "full_attention"),
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_chunk_size=4)
    sampler = JaxSampler(hybrid, max_cache_len=64, max_batch=8)
    out = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    all_logits = full_logits(hybrid, [p + s.output_ids.tolist() for p, (s,) in zip(PROMPTS, out, strict=True)])
    for prompt, (sample,), logits in zip(PROMPTS, out, all_logits, strict=True):
        steps = logits[len(prompt) - 1:len(prompt) + 7]
        np.testing.assert_array_equal(sample.output_ids, np.argmax(steps, axis=-1))
        expected = special.log_softmax(steps.astype(np.float64), axis=-1)[np.arange(8), sample.output_ids]
        np.testing.assert_allclose(sample.output_logprobs, expected, atol=5e-5)
    # Three samples per prompt share one prefill (its recurrent states copied to each sample).
    out = sampler.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=2), n=3)
    pairs = [(p, s) for p, group in zip(PROMPTS, out, strict=True) for s in group]
    all_logits = full_logits(hybrid, [p + s.output_ids.tolist() for p, s in pairs])
    for (prompt, sample), logits in zip(pairs, all_logits, strict=True):
        steps = logits[len(prompt) - 1:len(prompt) + 7]
        expected = special.log_softmax(steps.astype(np.float64), axis=-1)[np.arange(8), sample.output_ids]
        # sampled tokens are less likely than greedy ones: float32 noise relative to |logp|
        np.testing.assert_allclose(sample.output_logprobs, expected, atol=5e-5, rtol=5e-5)
