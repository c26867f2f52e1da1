"""CISPO, GMPO, REINFORCE and SAPO token losses against closed forms written here in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import aggregation, policy

NEW_KINDS = ("cispo", "gmpo", "reinforce", "sapo")

# Two sequences of four positions; the last token of row 0 is padding. The log ratios put tokens on both
# sides of the CISPO range [0.8, 1.28] and the GMPO log range [-0.4, 0.4], away from the bounds.
OLD = np.log(np.array([[0.5, 0.3, 0.6, 0.4], [0.2, 0.7, 0.4, 0.1]]))
LOG_RATIO = np.array([[0.1, 0.5, -0.6, 0.0], [-0.5, 0.45, 0.05, -0.2]])
LOGP = OLD + LOG_RATIO
MASK = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
TOKEN_ADV = np.array([[1.5, 0.7, -2.0, 9.9], [-0.8, -0.5, 1.2, 0.0]])  # both clip sides, A = 0, wrong side
SEQ_ADV = np.array([1.5, -0.8])


def _j(x):
    return jnp.asarray(np.asarray(x, np.float32))


def _call(kind, logp=LOGP, old=OLD, adv=TOKEN_ADV, mask=MASK, **kw):
    kw.setdefault("eps_low", 0.2)
    kw.setdefault("eps_high", 0.28)
    return policy.policy_token_loss(kind, _j(logp), _j(old), _j(adv), _j(mask), **kw)


def _grad(kind, logp=LOGP, old=OLD, adv=TOKEN_ADV, mask=MASK, **kw):
    kw.setdefault("eps_low", 0.2)
    kw.setdefault("eps_high", 0.28)
    return np.asarray(jax.grad(lambda lp: jnp.sum(policy.policy_token_loss(
        kind, lp, _j(old), _j(adv), _j(mask), **kw)[0]))(_j(logp)))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# --- numpy closed forms (float64) -----------------------------------------------------------------------------

def np_cispo(logp, old, adv, mask, eps_low, eps_high):
    ratio = np.exp(logp - old)
    weight = np.clip(ratio, 1 - eps_low, 1 + eps_high)
    return -weight * adv * logp * mask, -weight * adv * mask  # loss, d(sum loss)/d logp


def np_gmpo_clipped_log_ratio(log_ratio, adv, eps_low, eps_high):
    """Per token: the log ratio after GMPO's sign-aware clip, and whether it still depends on logp."""
    upper = (adv > 0) & (log_ratio > eps_high)
    lower = (adv < 0) & (log_ratio < -eps_low)
    clipped = np.where(upper, eps_high, np.where(lower, -eps_low, log_ratio))
    clipped = np.where(adv == 0, 0.0, clipped)  # sign(A) = 0 drops the token from the mean
    return clipped, ~(upper | lower) & (adv != 0)


def np_gmpo(logp, old, adv, mask, eps_low, eps_high):
    c, free = np_gmpo_clipped_log_ratio(logp - old, adv, eps_low, eps_high)
    n = mask.sum(1, keepdims=True)
    s = np.exp((c * mask).sum(1, keepdims=True) / n)
    return -adv * s * mask, -adv * s * free * mask, s


def np_sapo(logp, old, adv, mask, tau_pos, tau_neg):
    ratio = np.exp(logp - old)
    tau = np.where(adv > 0, tau_pos, tau_neg)
    sig = _sigmoid(tau * (ratio - 1))
    return -adv * sig * 4 / tau * mask, -adv * 4 * sig * (1 - sig) * ratio * mask


# --- values and gradients -------------------------------------------------------------------------------------

def test_cispo_value_gradient_and_metrics():
    for eps_low, eps_high in [(0.2, 0.28), (1.0, 0.28)]:  # two-sided (verl) and upper-only (MiniMax-M1)
        loss, metrics = _call("cispo", eps_low=eps_low, eps_high=eps_high)
        want_loss, want_grad = np_cispo(LOGP, OLD, TOKEN_ADV, MASK, eps_low, eps_high)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(_grad("cispo", eps_low=eps_low, eps_high=eps_high), want_grad, rtol=1e-5,
                                   atol=1e-7)
        ratio = np.exp(LOG_RATIO)
        live = MASK > 0
        high, low = live & (ratio > 1 + eps_high), live & (ratio < 1 - eps_low)
        np.testing.assert_allclose(metrics["clip_frac_high"], high.sum() / live.sum(), rtol=1e-6)
        np.testing.assert_allclose(metrics["clip_frac_low"], low.sum() / live.sum(), rtol=1e-6)
        np.testing.assert_allclose(metrics["clip_frac"], (high | low).sum() / live.sum(), rtol=1e-6)
        np.testing.assert_allclose(metrics["ratio_mean"], ratio[live].mean(), rtol=1e-5)
        np.testing.assert_allclose(metrics["ratio_max"], ratio[live].max(), rtol=1e-5)
    assert float(metrics["clip_frac_low"]) == 0.0  # eps_low = 1: no lower bound
    # A clipped weight still passes gradient: token (0, 1) has rho = e^0.5 > 1.28 and gradient -0.7 * 1.28.
    np.testing.assert_allclose(_grad("cispo")[0, 1], -0.7 * 1.28, rtol=1e-6)


@pytest.mark.parametrize("advantages", ["sequence", "token"])
def test_gmpo_value_gradient_and_metrics(advantages):
    adv = np.repeat(SEQ_ADV[:, None], 4, axis=1) if advantages == "sequence" else TOKEN_ADV
    eps_low, eps_high = 0.4, 0.4
    loss, metrics = _call("gmpo", adv=adv, eps_low=eps_low, eps_high=eps_high)
    want_loss, want_grad, s = np_gmpo(LOGP, OLD, adv, MASK, eps_low, eps_high)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_grad("gmpo", adv=adv, eps_low=eps_low, eps_high=eps_high), want_grad, rtol=1e-5,
                               atol=1e-7)
    live = MASK > 0
    high = live & (adv > 0) & (LOG_RATIO > eps_high)
    low = live & (adv < 0) & (LOG_RATIO < -eps_low)
    assert high.any() and low.any()
    np.testing.assert_allclose(metrics["clip_frac_high"], high.sum() / live.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac_low"], low.sum() / live.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac"], (high | low).sum() / live.sum(), rtol=1e-6)
    seq_ratio = np.broadcast_to(s, MASK.shape)[live]
    np.testing.assert_allclose(metrics["ratio_mean"], seq_ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_max"], seq_ratio.max(), rtol=1e-5)
    # Under seq-mean-token-mean the value is verl's geo_mean: -(sequence mean of A) * s_i, averaged over sequences.
    mode = "seq-mean-token-mean"
    got = aggregation.aggregate_loss(loss, _j(MASK), mode, aggregation.loss_normalizer(mode, _j(MASK)))
    mean_adv = (adv * MASK).sum(1) / MASK.sum(1)
    np.testing.assert_allclose(got, np.mean(-mean_adv * s[:, 0]), rtol=1e-5)


def _np_gmpo_paper_objective(logp, seq_adv, eps_low, eps_high):
    """(1/G) sum_i -A_i (prod_t clipped rho_t)^(1/|y_i|), straight from the paper (verl's geo_mean)."""
    total = 0.0
    for i in range(len(seq_adv)):
        live = MASK[i] > 0
        lr = logp[i][live] - OLD[i][live]
        sign = np.sign(seq_adv[i])
        clipped = sign * np.minimum(sign * lr, sign * np.clip(lr, -eps_low, eps_high))
        total += -seq_adv[i] * np.prod(np.exp(clipped)) ** (1 / live.sum())
    return total / len(seq_adv)


def test_gmpo_seq_mean_token_mean_is_the_paper_objective():
    adv = np.repeat(SEQ_ADV[:, None], 4, axis=1)
    mode = "seq-mean-token-mean"

    def agg(lp):
        tl, _ = policy.policy_token_loss("gmpo", lp, _j(OLD), _j(adv), _j(MASK), eps_low=0.4, eps_high=0.4)
        return aggregation.aggregate_loss(tl, _j(MASK), mode, aggregation.loss_normalizer(mode, _j(MASK)))

    np.testing.assert_allclose(agg(_j(LOGP)), _np_gmpo_paper_objective(LOGP, SEQ_ADV, 0.4, 0.4), rtol=1e-5)
    # Central differences of the numpy objective (float64) on every generated token.
    h = 1e-6
    want = np.zeros_like(LOGP)
    for b, t in zip(*np.nonzero(MASK), strict=True):
        step = np.zeros_like(LOGP)
        step[b, t] = h
        want[b, t] = (_np_gmpo_paper_objective(LOGP + step, SEQ_ADV, 0.4, 0.4)
                      - _np_gmpo_paper_objective(LOGP - step, SEQ_ADV, 0.4, 0.4)) / (2 * h)
    np.testing.assert_allclose(jax.grad(agg)(_j(LOGP)), want, rtol=1e-4, atol=1e-6)


def test_reinforce_value_and_gradient_ignore_the_ratio():
    for old in (OLD, OLD - 3.0):  # on and far off policy: the same gradient -A
        loss, metrics = _call("reinforce", old=old)
        np.testing.assert_allclose(loss, -TOKEN_ADV * LOGP * MASK, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(_grad("reinforce", old=old), -TOKEN_ADV * MASK, rtol=1e-6, atol=0)
        ratio = np.exp(LOGP - old)[MASK > 0]
        np.testing.assert_allclose(metrics["ratio_mean"], ratio.mean(), rtol=1e-5)
        np.testing.assert_allclose(metrics["ratio_max"], ratio.max(), rtol=1e-5)
        assert set(metrics) == {"ratio_mean", "ratio_max"}


@pytest.mark.parametrize("taus", [None, (2.0, 3.0)])
def test_sapo_value_and_gradient(taus):
    tau_pos, tau_neg = taus or (1.0, 1.05)  # None: the registry's (the paper's) temperatures
    if taus is None:
        loss, metrics = _call("sapo")
        grad = _grad("sapo")
    else:
        kw = dict(tau_pos=tau_pos, tau_neg=tau_neg)
        loss, metrics = policy.sapo_token_loss(_j(LOGP), _j(OLD), _j(TOKEN_ADV), _j(MASK), **kw)
        grad = np.asarray(jax.grad(lambda lp: jnp.sum(policy.sapo_token_loss(
            lp, _j(OLD), _j(TOKEN_ADV), _j(MASK), **kw)[0]))(_j(LOGP)))
    want_loss, want_grad = np_sapo(LOGP, OLD, TOKEN_ADV, MASK, tau_pos, tau_neg)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    ratio = np.exp(LOG_RATIO)[MASK > 0]
    np.testing.assert_allclose(metrics["ratio_mean"], ratio.mean(), rtol=1e-5)
    assert set(metrics) == {"ratio_mean", "ratio_max"}


def test_sapo_on_policy_gradient_is_minus_the_advantage():
    grad = _grad("sapo", logp=OLD)
    np.testing.assert_allclose(grad, -TOKEN_ADV * MASK, rtol=1e-6, atol=1e-7)


# --- masks, registry, dtypes, options -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", NEW_KINDS)
def test_masked_tokens_give_zero_loss_and_gradient_whatever_they_hold(kind):
    hole = MASK == 0
    base_loss, base_metrics = _call(kind)
    base_grad = _grad(kind)
    assert np.all(np.asarray(base_loss)[hole] == 0.0) and np.all(base_grad[hole] == 0.0)
    junk = lambda x, v: np.where(hole, v, x)
    for logp, old, adv in [(junk(LOGP, 50.0), OLD, TOKEN_ADV), (LOGP, junk(OLD, -np.inf), TOKEN_ADV),
                           (LOGP, OLD, junk(TOKEN_ADV, 1e6)),
                           (junk(LOGP, np.nan), junk(OLD, np.nan), junk(TOKEN_ADV, np.nan))]:
        loss, metrics = _call(kind, logp=logp, old=old, adv=adv)
        np.testing.assert_array_equal(loss, base_loss)
        np.testing.assert_array_equal(_grad(kind, logp=logp, old=old, adv=adv), base_grad)
        for key in base_metrics:
            assert float(metrics[key]) == float(base_metrics[key]), key


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_registry_dispatch_matches_the_function_and_is_float32(kind):
    direct = {"cispo": policy.cispo_token_loss, "gmpo": policy.gmpo_token_loss,
              "reinforce": policy.reinforce_token_loss, "sapo": policy.sapo_token_loss}[kind]
    via_registry, _ = _call(kind)
    options = {"eps_low": 0.2, "eps_high": 0.28} if kind in ("cispo", "gmpo") else {}  # the clip losses'
    called, _ = direct(_j(LOGP), _j(OLD), _j(TOKEN_ADV), _j(MASK), **options)
    np.testing.assert_array_equal(via_registry, called)
    out = jax.jit(lambda lp: policy.policy_token_loss(kind, lp, _j(OLD), _j(TOKEN_ADV), _j(MASK), eps_low=0.2,
                                                      eps_high=0.28)[0])(_j(LOGP).astype(jnp.bfloat16))
    assert out.dtype == jnp.float32 and out.shape == MASK.shape


@pytest.mark.parametrize("kind", ["reinforce", "sapo"])
def test_losses_without_a_clip_ignore_eps(kind):
    np.testing.assert_array_equal(_call(kind, eps_low=0.9, eps_high=7.0)[0], _call(kind)[0])


@pytest.mark.parametrize("kind", list(policy.POLICY_LOSSES))
def test_dual_clip_is_refused_exactly_outside_dual_clip_losses(kind):
    if kind in policy.DUAL_CLIP_LOSSES:
        _call(kind, dual_clip=3.0)
        return
    with pytest.raises(ValueError) as err:
        _call(kind, dual_clip=3.0)
    assert "dual_clip=3.0" in str(err.value) and kind in str(err.value)


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda x: policy.cispo_token_loss(x, x, x, x, eps_low=1.5), ["eps_low", "1.5"]),
        (lambda x: policy.cispo_token_loss(x, x, x, x, eps_high=-0.1), ["eps_high"]),
        (lambda x: policy.gmpo_token_loss(x, x, x, x, eps_low=-0.4), ["eps_low"]),
        (lambda x: policy.gmpo_token_loss(x, x, x, x, eps_high=-0.4), ["eps_high"]),
        (lambda x: policy.sapo_token_loss(x, x, x, x, tau_neg=0.0), ["tau_neg"]),
        (lambda x: policy.sapo_token_loss(x, x, x, x, tau_pos=-1.0), ["tau_pos"]),
        (lambda x: policy.policy_token_loss("reinforce", x, x, x, x, eps_low=0.2, eps_high=0.28, dual_clip=2.0),
         ["dual_clip", "reinforce"]),
        (lambda x: policy.reinforce_token_loss(x, x[0], x, x), ["old_logp"]),
        (lambda x: policy.gmpo_token_loss(x.astype(jnp.int32), x, x, x), ["logp", "int32"]),
        (lambda x: policy.sapo_token_loss(x, x, x, jnp.ones((2, 4))), ["mask", "(2, 4)"]),
    ],
)
def test_bad_options_name_the_option(call, names):
    with pytest.raises(ValueError) as err:
        call(jnp.ones((2, 3)))
    for name in names:
        assert name in str(err.value)
