"""SPEC section 4: chunked LM-head logprobs/entropy, entropy bonus, Clip-Cov, KL-Cov, entropy law.

References are numpy float64 closed forms, autodiff of the naive (full-logits)
computation, or hand-made inputs whose answers are known.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import entropy as E


def _np_log_softmax(z):
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _naive(hidden, lm_head, targets, bias=None):
    logits = jnp.einsum("btd,dv->btv", hidden, lm_head, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


@pytest.fixture(scope="module")
def head_inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    batch, length, dim, vocab = 2, 7, 8, 37  # 14 tokens, prime vocab
    hidden = 2.0 * jax.random.normal(keys[0], (batch, length, dim))
    lm_head = jax.random.normal(keys[1], (dim, vocab))
    bias = jax.random.normal(keys[2], (vocab,))
    targets = jax.random.randint(keys[3], (batch, length), 0, vocab)
    # Random cotangents so both outputs contribute to the gradient.
    g_logp = jax.random.normal(keys[4], (batch, length))
    g_entropy = jax.random.normal(keys[5], (batch, length))
    return hidden, lm_head, bias, targets, g_logp, g_entropy


def _values_and_grads(head, targets, g_logp, g_entropy):
    """jit(h, w, b) -> (logp, entropy, (d_hidden, d_lm_head, d_bias)) for cotangents (g_logp, g_entropy)."""
    def run(h, w, b):
        (logp, entropy), pullback = jax.vjp(lambda h, w, b: head(h, w, targets, b), h, w, b)
        return logp, entropy, pullback((g_logp, g_entropy))
    return jax.jit(run)


# Token chunks and vocab tiles that do / do not divide 14 tokens and a vocabulary of 37.
@pytest.mark.parametrize("chunk_size,vocab_chunk_size,with_bias",
                         [(3, 10, False), (5, None, True), (4, 36, True), (100, 8, False)])
def test_chunked_head_matches_naive_value_and_gradient(head_inputs, chunk_size, vocab_chunk_size, with_bias):
    hidden, lm_head, bias, targets, g_logp, g_entropy = head_inputs
    bias = bias if with_bias else jnp.zeros_like(bias)

    # Values against a float64 numpy closed form.
    logits = np.einsum("btd,dv->btv", np.float64(hidden), np.float64(lm_head)) + np.float64(bias)
    log_probs = _np_log_softmax(logits)
    want_logp = np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]
    want_entropy = -(np.exp(log_probs) * log_probs).sum(-1)

    def chunked(h, w, y, b):
        return E.token_logprobs_and_entropy(h, w, y, chunk_size=chunk_size,
                                            vocab_chunk_size=vocab_chunk_size, bias=b)

    logp, entropy, grads = _values_and_grads(chunked, targets, g_logp, g_entropy)(hidden, lm_head, bias)
    assert logp.dtype == jnp.float32 and entropy.dtype == jnp.float32
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)

    # Gradients w.r.t. hidden, lm_head and bias against autodiff of the naive computation.
    _, _, want = _values_and_grads(_naive, targets, g_logp, g_entropy)(hidden, lm_head, bias)
    for name, got, expected in zip(("hidden", "lm_head", "bias"), grads, want):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5, err_msg=name)


def test_chunked_head_without_bias_matches_naive_gradient(head_inputs):
    hidden, lm_head, _, targets, g_logp, g_entropy = head_inputs

    def loss(head):
        def f(h, w):
            logp, entropy = head(h, w)
            return jnp.sum(logp * g_logp) + jnp.sum(entropy * g_entropy)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    got = loss(lambda h, w: E.token_logprobs_and_entropy(h, w, targets, chunk_size=3, vocab_chunk_size=10))
    want = loss(lambda h, w: _naive(h, w, targets))
    for g, w in zip(got(hidden, lm_head), want(hidden, lm_head)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5)


def test_chunked_head_bfloat16_inputs_accumulate_in_float32(head_inputs):
    hidden, lm_head, _, targets, g_logp, g_entropy = head_inputs
    h16, w16 = hidden.astype(jnp.bfloat16), lm_head.astype(jnp.bfloat16)
    # Reference: the bf16 values promoted to float64 exactly.
    logits = np.einsum("btd,dv->btv", np.float64(h16.astype(jnp.float32)), np.float64(w16.astype(jnp.float32)))
    log_probs = _np_log_softmax(logits)
    want_logp = np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]
    logp, entropy = jax.jit(lambda h, w: E.token_logprobs_and_entropy(
        h, w, targets, chunk_size=4, vocab_chunk_size=16))(h16, w16)
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, -(np.exp(log_probs) * log_probs).sum(-1), rtol=1e-5, atol=1e-5)

    chunked = lambda h, w, y, b: E.token_logprobs_and_entropy(h, w, y, chunk_size=4, vocab_chunk_size=16)
    _, _, (d_h, d_w, _) = _values_and_grads(chunked, targets, g_logp, g_entropy)(h16, w16, None)
    assert d_h.dtype == jnp.bfloat16 and d_w.dtype == jnp.bfloat16
    naive = lambda h, w, y, b: _naive(h, w, y)
    _, _, (want_h, want_w, _) = _values_and_grads(naive, targets, g_logp, g_entropy)(
        h16.astype(jnp.float32), w16.astype(jnp.float32), None)
    # One bf16 rounding of the result: relative 2**-8.
    np.testing.assert_allclose(d_h.astype(jnp.float32), want_h, rtol=8e-3, atol=8e-3)
    np.testing.assert_allclose(d_w.astype(jnp.float32), want_w, rtol=8e-3, atol=8e-3)


def test_chunked_head_never_holds_full_logits():
    """Compiled forward+backward temporaries stay far below one [N, V] float32 array."""
    tokens, dim, vocab = 1024, 16, 4096
    full_logits_bytes = tokens * vocab * 4
    shapes = (jax.ShapeDtypeStruct((1, tokens, dim), jnp.float32),
              jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
              jax.ShapeDtypeStruct((1, tokens), jnp.int32))

    def temp_bytes(head):
        def loss(h, w, y):
            logp, ent = head(h, w, y)
            return jnp.sum(logp) + jnp.sum(ent)
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(lambda h, w, y: E.token_logprobs_and_entropy(h, w, y, chunk_size=128, vocab_chunk_size=512))
    naive = temp_bytes(_naive)
    assert naive >= full_logits_bytes  # the reference does hold it
    assert chunked < full_logits_bytes / 4, (chunked, full_logits_bytes)


def test_entropy_and_logprobs_from_logits_closed_form():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 5, 11)) * 3
    targets = rng.integers(0, 11, size=(3, 5))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want_entropy = -(p * np.log(p)).sum(-1)
    want_logp = np.log(np.take_along_axis(p, targets[..., None], -1)[..., 0])
    entropy = E.token_entropy_from_logits(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(E.token_entropy_from_logits(jnp.asarray(logits, jnp.float32)), want_entropy,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(E.token_logprobs_from_logits(jnp.asarray(logits, jnp.float32), jnp.asarray(targets)),
                               want_logp, rtol=1e-5, atol=1e-6)
    assert E.token_entropy_from_logits(jnp.asarray(logits, jnp.bfloat16)).dtype == jnp.float32
    assert entropy.shape == (3, 5)
    # Uniform over V: entropy log V; one-hot-ish: near 0.
    np.testing.assert_allclose(E.token_entropy_from_logits(jnp.zeros((2, 7))), np.log(7), rtol=1e-6)
    assert float(E.token_entropy_from_logits(jnp.array([100.0, 0.0, 0.0]))) < 1e-40 + 1e-6


def test_entropy_bonus_is_negative_coef_times_entropy_on_mask():
    entropy = jnp.array([[1.0, 2.0, 3.0], [0.5, 9.0, 7.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_allclose(E.entropy_bonus(entropy, mask, coef=0.1),
                               [[-0.1, -0.2, 0.0], [-0.05, 0.0, 0.0]], rtol=1e-6)
    grad = jax.grad(lambda h: jnp.sum(E.entropy_bonus(h, mask, coef=0.1)))(entropy)
    np.testing.assert_allclose(grad, -0.1 * np.asarray(mask, np.float32))


# --------------------------------------------------------------------------- #
# Clip-Cov / KL-Cov
# --------------------------------------------------------------------------- #
def _cov_inputs():
    """logp and A whose centred products over the 6 masked tokens are known.

    Masked logp = [-1, -2, -3, -4, -5, -3] (mean -3), A = [2, 1, 0, -1, -2, 0] (mean 0):
    Cov = [4, 1, 0, 1, 4, 0] on the masked tokens.
    """
    logp = jnp.array([[-1.0, -2.0, -3.0, -7.0], [-4.0, -5.0, -3.0, -9.0]])
    adv = jnp.array([[2.0, 1.0, 0.0, 5.0], [-1.0, -2.0, 0.0, 5.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 0]])
    return logp, adv, mask


def test_centered_cov_hand_values():
    logp, adv, mask = _cov_inputs()
    np.testing.assert_allclose(E.centered_cov(logp, adv, mask), [[4, 1, 0, 0], [1, 4, 0, 0]], atol=1e-6)


def test_clip_cov_selects_all_band_tokens_when_budget_allows():
    logp, adv, mask = _cov_inputs()
    # N = 6, ratio 0.5 -> budget 3 >= the 2 tokens with 1 <= Cov <= 2 (positions (0,1), (1,0)).
    detach, metrics = E.clip_cov_mask(logp, adv, mask, jax.random.key(0), ratio=0.5,
                                      omega_low=1.0, omega_high=2.0)
    np.testing.assert_array_equal(detach, [[False, True, False, False], [True, False, False, False]])
    assert int(metrics["clip_cov_count"]) == 2 and int(metrics["clip_cov_candidates"]) == 2
    np.testing.assert_allclose(metrics["clip_cov_fraction"], 2 / 6)
    # Default band [1, 5]: Cov in {4, 1, 1, 4}; ratio 1/6 -> exactly one of those four.
    detach, metrics = jax.jit(lambda k: E.clip_cov_mask(logp, adv, mask, k, ratio=1 / 6))(jax.random.key(3))
    assert int(metrics["clip_cov_count"]) == 1 and int(jnp.sum(detach)) == 1
    cov = np.asarray(E.centered_cov(logp, adv, mask))
    assert 1.0 <= cov[np.asarray(detach)][0] <= 5.0


def test_clip_cov_seeded_reproducible_and_uniform():
    logp, adv, mask = _cov_inputs()
    select = jax.jit(jax.vmap(lambda k: E.clip_cov_mask(logp, adv, mask, k, ratio=1 / 6)[0]))
    keys = jax.random.split(jax.random.key(42), 800)
    first, again = select(keys), select(keys)
    np.testing.assert_array_equal(first, again)
    counts = np.asarray(first).reshape(800, -1).sum(0)
    # The four band tokens (flat positions 0, 1, 4, 5) are picked about 200 times each.
    assert counts.sum() == 800 and set(np.flatnonzero(counts)) == {0, 1, 4, 5}
    assert np.all(np.abs(counts[[0, 1, 4, 5]] - 200) < 60), counts  # > 4 sigma


@pytest.mark.parametrize("num_tokens,want", [(5000, 1), (4999, 0), (15000, 3)])
def test_clip_cov_count_is_floor_of_ratio_times_n(num_tokens, want):
    # Every token in the band: logp = +-1 alternating with A equal to 3 * logp -> Cov = 3.
    sign = np.where(np.arange(num_tokens) % 2 == 0, 1.0, -1.0)
    if num_tokens % 2:
        sign[-1] = 0.0  # keep the means at 0; Cov 0 is outside the band
    logp = jnp.asarray(sign, jnp.float32)[None]
    detach, metrics = jax.jit(E.clip_cov_mask)(logp, 3.0 * logp, jnp.ones_like(logp), jax.random.key(0))
    assert int(metrics["clip_cov_count"]) == want == int(jnp.sum(detach))


def test_kl_cov_selects_top_cov_and_penalises_abs_gap():
    logp, adv, mask = _cov_inputs()
    old = logp + jnp.array([[0.5, -0.25, 0.1, 3.0], [0.2, -0.3, 0.0, 3.0]])
    # N = 6, ratio 0.34 -> floor(2.04) = 2: the two Cov = 4 tokens, (0,0) and (1,1).
    penalty, selected, metrics = E.kl_cov_penalty(logp, old, adv, mask, ratio=0.34, beta=2.0)
    np.testing.assert_array_equal(selected, [[True, False, False, False], [False, True, False, False]])
    np.testing.assert_allclose(penalty, [[1.0, 0, 0, 0], [0, 0.6, 0, 0]], rtol=1e-6)
    assert int(metrics["kl_cov_count"]) == 2
    grad = jax.grad(lambda lp: jnp.sum(E.kl_cov_penalty(lp, old, adv, mask, ratio=0.34, beta=2.0)[0]))(logp)
    # d/dlogp 2|logp - old| = 2 sign(logp - old): -2 at (0,0) (logp < old), +2 at (1,1).
    np.testing.assert_allclose(grad, [[-2.0, 0, 0, 0], [0, 2.0, 0, 0]])
    # ratio 0.5 -> 3 tokens: the Cov = 4 pair and the first Cov = 1 token by position, (0,1).
    _, selected, _ = E.kl_cov_penalty(logp, old, adv, mask, ratio=0.5)
    np.testing.assert_array_equal(selected, [[True, True, False, False], [False, True, False, False]])


def test_cov_controls_ignore_masked_tokens():
    logp, adv, mask = _cov_inputs()
    old = logp - 0.5
    poke = jnp.array([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]) * 1e3
    key = jax.random.key(7)
    base = (E.clip_cov_mask(logp, adv, mask, key, ratio=1 / 3),
            E.kl_cov_penalty(logp, old, adv, mask, ratio=0.34))
    poked = (E.clip_cov_mask(logp + poke, adv - poke, mask, key, ratio=1 / 3),
             E.kl_cov_penalty(logp + poke, old - poke, adv + poke, mask, ratio=0.34))
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(poked)):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- #
# Entropy-performance law
# --------------------------------------------------------------------------- #
def test_entropy_law_fit_recovers_known_parameters():
    a, b = 0.35, 0.9
    entropy = np.linspace(1.2, 0.05, 40)
    reward = -a * np.exp(entropy) + b
    fit = jax.jit(E.fit_entropy_law)(jnp.asarray(entropy, jnp.float32), jnp.asarray(reward, jnp.float32))
    np.testing.assert_allclose([fit.a, fit.b, fit.ceiling], [a, b, b - a], rtol=1e-4)
    assert float(fit.rmse) < 1e-5
    # With noise of known size the RMSE reports it and a, b stay close.
    noise = 0.01 * np.where(np.arange(40) % 2 == 0, 1.0, -1.0)
    fit = E.fit_entropy_law(jnp.asarray(entropy, jnp.float32), jnp.asarray(reward + noise, jnp.float32))
    np.testing.assert_allclose([fit.a, fit.b], [a, b], atol=5e-3)
    np.testing.assert_allclose(fit.rmse, 0.01, rtol=0.05)


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
def test_bad_input_names_the_argument():
    h, w, y = jnp.zeros((2, 3, 4)), jnp.zeros((4, 5)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="lm_head"):
        E.token_logprobs_and_entropy(h, jnp.zeros((5, 4)), y)
    with pytest.raises(ValueError, match="targets"):
        E.token_logprobs_and_entropy(h, w, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="targets"):
        E.token_logprobs_and_entropy(h, w, jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="hidden"):
        E.token_logprobs_and_entropy(jnp.zeros((6, 4)), w, y)
    with pytest.raises(ValueError, match="chunk_size"):
        E.token_logprobs_and_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        E.token_logprobs_and_entropy(h, w, y, vocab_chunk_size=-2)
    with pytest.raises(ValueError, match="bias"):
        E.token_logprobs_and_entropy(h, w, y, bias=jnp.zeros(4))
    logp, mask = jnp.zeros((2, 3)), jnp.ones((2, 3))
    with pytest.raises(ValueError, match="advantages"):
        E.clip_cov_mask(logp, jnp.zeros((2, 4)), mask, jax.random.key(0))
    with pytest.raises(ValueError, match="ratio"):
        E.clip_cov_mask(logp, logp, mask, jax.random.key(0), ratio=1.5)
    with pytest.raises(ValueError, match="omega_low"):
        E.clip_cov_mask(logp, logp, mask, jax.random.key(0), omega_low=6.0)
    with pytest.raises(ValueError, match="old_logp"):
        E.kl_cov_penalty(logp, jnp.zeros((3, 2)), logp, mask)
    with pytest.raises(ValueError, match="beta"):
        E.kl_cov_penalty(logp, logp, logp, mask, beta=-1.0)
    with pytest.raises(ValueError, match="coef"):
        E.entropy_bonus(logp, mask, coef=-0.1)
    with pytest.raises(ValueError, match="reward"):
        E.fit_entropy_law(jnp.zeros(4), jnp.zeros(5))
    with pytest.raises(ValueError, match="entropy"):
        E.fit_entropy_law(jnp.zeros(1), jnp.zeros(1))
