"""docs/losses.md#entropy-and-its-control: logprobs/entropy from logits, entropy bonus, Clip-Cov, KL-Cov, entropy law.

References are numpy float64 closed forms or hand-made inputs whose answers are
known. The chunked LM head is tested in tests/models/test_lm_head.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import entropy as E


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
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(poked), strict=True):
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
