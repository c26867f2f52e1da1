"""Policy losses: clip gradients, GSPO ratios, masks and micro-batch invariance against closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import aggregation, policy

B, T = 8, 6


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 0.95, size=(B, T))).astype(np.float32)
    logp = (old + rng.normal(0, 0.4, size=(B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[0] = 0  # one sequence with no generated tokens
    lengths[1] = T
    prompt = rng.integers(0, 2, size=B)
    mask = np.zeros((B, T), np.float32)
    for b in range(B):
        mask[b, prompt[b] : prompt[b] + lengths[b]] = 1.0
    return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask)


def _summed_grad(kind, logp, old, adv, mask, **kw):
    return jax.grad(lambda lp: jnp.sum(policy.policy_token_loss(kind, lp, old, adv, mask, **kw)[0]))(logp)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_gradient_is_zero_exactly_where_the_clip_binds(dual_clip):
    eps_low, eps_high = 0.2, 0.28
    ratios = np.array([0.3, 0.7, 0.79, 0.81, 1.0, 1.2, 1.27, 1.29, 2.0, 2.9, 3.1, 5.0], np.float32)
    ratio = np.concatenate([ratios, ratios])[None]
    adv = np.concatenate([np.full(12, 1.5), np.full(12, -0.5)]).astype(np.float32)[None]
    old = np.full_like(ratio, -1.0)
    logp = old + np.log(ratio)
    mask = np.ones_like(ratio)
    grad = _summed_grad("ppo", jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    binds = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    if dual_clip is not None:
        binds |= (adv < 0) & (ratio > dual_clip)
    # d(-A rho)/d logp = -A rho where unclipped; exactly 0 where clipped.
    expected = np.where(binds, 0.0, -adv * ratio)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=0)
    assert np.all(np.asarray(grad)[binds] == 0.0)
    _, metrics = policy.ppo_clip_token_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                            eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    np.testing.assert_allclose(metrics["clip_frac"], binds.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac_high"], ((adv > 0) & (ratio > 1 + eps_high)).mean(), rtol=1e-6)
    # Dual clip bounds the loss of A<0 tokens at -c*A.
    loss, _ = policy.ppo_clip_token_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                         eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    plain = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high))
    if dual_clip is not None:
        plain = np.where(adv < 0, np.minimum(plain, -adv * dual_clip), plain)
    np.testing.assert_allclose(loss, plain, rtol=1e-5)


def test_gspo_ratio_is_geometric_mean_of_token_ratios():
    logp, old, adv, mask = _batch(1)
    token_ratio = np.exp(np.asarray(logp) - np.asarray(old))
    m = np.asarray(mask).astype(bool)
    got = np.exp(np.asarray(policy.gspo_log_ratio(logp, old, mask)))
    for b in range(B):
        if m[b].any():
            np.testing.assert_allclose(got[b], np.prod(token_ratio[b][m[b]]) ** (1 / m[b].sum()), rtol=1e-5)
        else:
            assert got[b] == 1.0


def test_gspo_and_gspo_token_values_and_gradients():
    logp, old, _, mask = _batch(2)
    seq_adv = np.linspace(-1, 1, B).astype(np.float32)
    adv = jnp.asarray(seq_adv[:, None] * np.asarray(mask))
    m = np.asarray(mask)
    n = np.maximum(m.sum(1), 1)
    s = np.exp(((np.asarray(logp) - np.asarray(old)) * m).sum(1) / n)
    eps = 0.05
    clipped = ((seq_adv > 0) & (s > 1 + eps)) | ((seq_adv < 0) & (s < 1 - eps))
    expected_loss = np.maximum(-seq_adv * s, -seq_adv * np.clip(s, 1 - eps, 1 + eps))[:, None] * m
    for kind in ("gspo", "gspo-token"):
        loss, _ = policy.policy_token_loss(kind, logp, old, adv, mask, eps_low=eps, eps_high=eps)
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-7)
    # GSPO: d/dlogp_t of sum_t' (-A s) = n * (-A s / n) = -A s (n equal token losses, ds/dlogp_t = s/n).
    grad = _summed_grad("gspo", logp, old, adv, mask, eps_low=eps, eps_high=eps)
    expected = np.where(clipped, 0.0, -seq_adv * s)[:, None] * m  # n tokens each contributing 1/n
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
    # GSPO-token: each token's own loss -A s has gradient -A s through its own logp.
    grad_tok = _summed_grad("gspo-token", logp, old, adv, mask, eps_low=eps, eps_high=eps)
    np.testing.assert_allclose(grad_tok, expected, rtol=1e-5, atol=1e-7)
    # Under seq-mean-token-mean the two variants give the same gradient for sequence advantages.
    def agg(kind, lp):
        tl, _ = policy.policy_token_loss(kind, lp, old, adv, mask, eps_low=eps, eps_high=eps)
        return aggregation.aggregate_loss(tl, mask, "seq-mean-token-mean",
                                     aggregation.loss_normalizer("seq-mean-token-mean", mask))
    num_seqs = m.any(1).sum()  # d/dlogp_t of (1/S) sum_b (1/n_b) sum_t -A s_b = -A s_b / (S n_b)
    np.testing.assert_allclose(jax.grad(lambda lp: agg("gspo", lp))(logp) * n[:, None] * num_seqs,
                               expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.grad(lambda lp: agg("gspo", lp))(logp),
                               jax.grad(lambda lp: agg("gspo-token", lp))(logp), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", policy.POLICY_LOSSES)
def test_masked_tokens_change_nothing(kind):
    logp, old, adv, mask = _batch(3)
    hole = np.asarray(mask) == 0
    junk = lambda x, v: jnp.where(jnp.asarray(hole), v, x)  # noqa: E731
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0 if kind in policy.DUAL_CLIP_LOSSES else None)

    def run(lp, ol, ad):
        (tl, metrics) = policy.policy_token_loss(kind, lp, ol, ad, mask, **kw)
        return aggregation.aggregate_loss(tl, mask, "token-mean", 10.0), metrics

    base_loss, base_metrics = run(logp, old, adv)
    base_grad = jax.grad(lambda lp: run(lp, old, adv)[0])(logp)
    for lp, ol, ad in [(junk(logp, 50.0), old, adv), (logp, junk(old, -jnp.inf), adv),
                       (logp, old, junk(adv, 1e6)), (junk(logp, jnp.nan), junk(old, jnp.nan), junk(adv, jnp.nan))]:
        loss, metrics = run(lp, ol, ad)
        assert float(loss) == float(base_loss)
        for key in base_metrics:
            assert float(metrics[key]) == float(base_metrics[key]), key
        grad = jax.grad(lambda x, ol=ol, ad=ad: run(x, ol, ad)[0])(lp)
        np.testing.assert_array_equal(grad, base_grad)


def _np_aggregate(loss, mask, mode, max_length):
    m = mask.astype(bool)
    seqs = m.any(1).sum()
    if mode == "token-mean":
        return (loss * m).sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return (loss * m).sum() / seqs
    if mode == "seq-mean-token-mean":
        return sum((loss[b] * m[b]).sum() / m[b].sum() for b in range(len(m)) if m[b].any()) / seqs
    return (loss * m).sum() / (seqs * max_length)


@pytest.mark.parametrize("mode", aggregation.AGGREGATION_MODES)
def test_aggregation_against_numpy(mode):
    _, _, loss, mask = _batch(4)
    expected = _np_aggregate(np.asarray(loss), np.asarray(mask), mode, 16)
    junk = jnp.where(mask > 0, loss, jnp.nan)  # whatever sits on masked tokens never reaches the loss
    got = aggregation.aggregate_loss(junk, mask, mode, aggregation.loss_normalizer(mode, mask, max_length=16))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("kind", policy.POLICY_LOSSES)
def test_micro_batch_split_gives_identical_loss_and_gradient(kind):
    logp, old, adv, mask = _batch(5)
    modes = aggregation.AGGREGATION_MODES

    def losses_by_mode(lp, splits):
        """[modes] loss of the batch split into ``splits`` micro-batches, each normalised globally."""
        out = []
        for mode in modes:
            normalizer = aggregation.loss_normalizer(mode, mask)  # once, on the global batch
            total = 0.0
            for idx in np.array_split(np.arange(B), splits):
                tl, _ = policy.policy_token_loss(kind, lp[idx], old[idx], adv[idx], mask[idx],
                                                 eps_low=0.2, eps_high=0.28)
                total = total + aggregation.aggregate_loss(tl, mask[idx], mode, normalizer)
            out.append(total)
        return jnp.stack(out)

    # One compiled program for every split and mode: far cheaper than op-by-op dispatch.
    @jax.jit
    def all_splits(lp):
        return [(losses_by_mode(lp, s), jax.jacrev(losses_by_mode)(lp, s)) for s in (1, 2, 4)]

    (full, full_grad), *others = all_splits(logp)
    assert np.all(np.abs(np.asarray(full_grad)).sum(axis=(1, 2)) > 0)
    for loss, grad in others:
        np.testing.assert_allclose(loss, full, rtol=1e-6)
        np.testing.assert_allclose(grad, full_grad, rtol=1e-6, atol=1e-9)


def test_jit_and_bfloat16_inputs_are_float32_inside():
    logp, old, adv, mask = _batch(6)
    f = jax.jit(lambda lp: policy.ppo_clip_token_loss(lp, old, adv, mask)[0])
    out = f(logp.astype(jnp.bfloat16))
    assert out.dtype == jnp.float32


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda x: policy.ppo_clip_token_loss(x, x, x, jnp.ones((2, 4))), ["mask", "(2, 4)"]),
        (lambda x: policy.ppo_clip_token_loss(x.astype(jnp.int32), x, x, x), ["logp", "int32"]),
        (lambda x: policy.ppo_clip_token_loss(x, x, x[0], x), ["advantages"]),
        (lambda x: policy.ppo_clip_token_loss(x[0], x[0], x[0], x[0]), ["logp", "rank 1"]),
        (lambda x: policy.ppo_clip_token_loss(x, x, x, x, eps_low=1.5), ["eps_low"]),
        (lambda x: policy.ppo_clip_token_loss(x, x, x, x, dual_clip=0.5), ["dual_clip"]),
        (lambda x: policy.policy_token_loss("ppo2", x, x, x, x, eps_low=0.2, eps_high=0.2), ["kind", "ppo2", "gspo"]),
        (lambda x: aggregation.aggregate_loss(x, x, "token-sum", 1.0), ["mode", "token-sum", "token-mean"]),
        (lambda x: aggregation.loss_normalizer("seq-sum", x), ["mode", "seq-sum"]),
        (lambda x: aggregation.aggregate_loss(x, x, "token-mean", jnp.ones(2)), ["normalizer"]),
    ],
)
def test_bad_input_names_the_argument(call, names):
    with pytest.raises(ValueError) as err:
        call(jnp.ones((2, 3)))
    for name in names:
        assert name in str(err.value)
