"""The abs and k3+ KL kinds and k3's clamp (docs/losses.md#kl-regularisers), against numpy closed forms:
values, gradients with respect to logp, masks, the unclamped default and argument errors."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import kl

# Hand-made [2, 4] batch: log_delta = ref - logp is -15, -1, 0, 0.5 / 2, 0.3, -0.3, 0 (last token masked).
LOGP = np.array([[-0.5, -1.0, -2.0, -3.0], [-4.0, -0.7, -0.2, -1.0]], np.float32)
REF = LOGP + np.array([[-15.0, -1.0, 0.0, 0.5], [2.0, 0.3, -0.3, 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)


def _np_k3(logp, ref):
    d = ref.astype(np.float64) - logp.astype(np.float64)
    return np.expm1(d) - d


def _grad(fn, logp=LOGP):
    return np.asarray(jax.grad(lambda lp: jnp.sum(fn(lp)))(jnp.asarray(logp)))


# --------------------------------------------------------------------------- #
# Registry
# --------------------------------------------------------------------------- #
def test_new_kinds_are_registered_once():
    assert "abs-as-loss" in kl.KL_REGULARIZERS and "k3+-as-loss" in kl.KL_REGULARIZERS
    assert len(set(kl.KL_REGULARIZERS)) == len(kl.KL_REGULARIZERS)
    assert kl.AS_LOSS_KINDS == tuple(k for k in kl.KL_REGULARIZERS if k != "k1-in-reward")
    assert set(kl.CLAMP_KINDS) == {"k3-as-loss", "k3+-as-loss"}


# --------------------------------------------------------------------------- #
# abs
# --------------------------------------------------------------------------- #
def test_kl_abs_value_and_gradient_is_the_sign():
    np.testing.assert_allclose(kl.kl_abs(jnp.asarray(LOGP), jnp.asarray(REF)), np.abs(LOGP - REF), rtol=1e-6)
    grad = _grad(lambda lp: kl.kl_abs(lp, jnp.asarray(REF)))
    # d|logp - ref| / d logp = sign(logp - ref), 0 where logp == ref (torch's abs; jnp.abs would give 1).
    np.testing.assert_array_equal(grad, np.sign(LOGP - REF))
    assert grad[0, 2] == 0.0 and grad[1, 3] == 0.0


def test_abs_as_loss_value_gradient_coefficient_and_mask():
    loss = kl.kl_as_loss("abs-as-loss", jnp.asarray(LOGP), jnp.asarray(REF), jnp.asarray(MASK))
    np.testing.assert_allclose(loss, np.abs(LOGP - REF) * MASK, rtol=1e-6)
    grad = _grad(lambda lp: kl.kl_as_loss("abs-as-loss", lp, jnp.asarray(REF), jnp.asarray(MASK)))
    np.testing.assert_array_equal(grad, np.sign(LOGP - REF) * MASK)
    np.testing.assert_array_equal(kl.kl_coefficient("abs-as-loss", LOGP, REF), np.sign(LOGP - REF))


# --------------------------------------------------------------------------- #
# k3+
# --------------------------------------------------------------------------- #
def test_k3_plus_has_k3_value_and_k2_gradient():
    fn = lambda lp: kl.kl_as_loss("k3+-as-loss", lp, jnp.asarray(REF), jnp.asarray(MASK))  # noqa: E731
    np.testing.assert_allclose(fn(jnp.asarray(LOGP)), _np_k3(LOGP, REF) * MASK, rtol=1e-5)
    # k2 = (logp - ref)^2 / 2 has gradient logp - ref; k3's would be 1 - exp(ref - logp).
    np.testing.assert_allclose(_grad(fn), (LOGP - REF) * MASK, rtol=1e-6)
    np.testing.assert_allclose(kl.kl_coefficient("k3+-as-loss", LOGP, REF), LOGP - REF, rtol=1e-6)


def test_k3_plus_expected_gradient_is_the_kl_gradient():
    """Over a categorical policy, E_{y~pi}[grad k3+(y)] = grad KL(pi || ref) exactly (k2's property)."""
    theta = np.array([0.3, -1.2, 0.8, 0.0, -0.4])
    ref = np.log(np.array([0.1, 0.3, 0.2, 0.25, 0.15]))
    pi = np.exp(theta - theta.max()) / np.exp(theta - theta.max()).sum()
    log_ratio = np.log(pi) - ref
    kl_grad = pi * (log_ratio - pi @ log_ratio)  # d/dtheta sum_y pi_y (log pi_y - ref_y)

    def grad_for(y):
        return jax.grad(lambda t: jnp.sum(kl.kl_as_loss(
            "k3+-as-loss", jax.nn.log_softmax(t)[y][None, None], jnp.asarray(ref, jnp.float32)[y][None, None],
            jnp.ones((1, 1)))))(jnp.asarray(theta, jnp.float32))

    grads = np.asarray(jax.vmap(grad_for)(jnp.arange(5)))
    np.testing.assert_allclose(pi @ grads, kl_grad, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- #
# k3 clamp
# --------------------------------------------------------------------------- #
def test_k3_default_is_unclamped():
    k3 = _np_k3(LOGP, REF)
    assert k3[0, 0] > 10  # log_delta = -15: k3 = 14
    np.testing.assert_allclose(kl.kl_k3(jnp.asarray(LOGP), jnp.asarray(REF)), k3, rtol=1e-5)
    np.testing.assert_allclose(kl.kl_k3(jnp.asarray(LOGP), jnp.asarray(REF), clamp=None), k3, rtol=1e-5)
    loss = kl.kl_as_loss("k3-as-loss", jnp.asarray(LOGP), jnp.asarray(REF), jnp.asarray(MASK))
    np.testing.assert_allclose(loss, k3 * MASK, rtol=1e-5)
    grad = _grad(lambda lp: kl.kl_as_loss("k3-as-loss", lp, jnp.asarray(REF), jnp.asarray(MASK)))
    np.testing.assert_allclose(grad, -np.expm1(REF - LOGP) * MASK, rtol=1e-5)


def test_k3_clamp_clips_the_value_and_zeroes_the_gradient_outside():
    k3 = _np_k3(LOGP, REF)
    inside = k3 <= 1.0  # clamp 1: tokens with log_delta -15 and 2 are outside
    np.testing.assert_array_equal(inside, [[False, True, True, True], [False, True, True, True]])
    value = kl.kl_k3(jnp.asarray(LOGP), jnp.asarray(REF), clamp=1.0)
    np.testing.assert_allclose(value, np.minimum(k3, 1.0), rtol=1e-5)
    grad = _grad(lambda lp: kl.kl_k3(lp, jnp.asarray(REF), clamp=1.0))
    np.testing.assert_allclose(grad, np.where(inside, -np.expm1(REF - LOGP), 0.0), rtol=1e-5, atol=1e-7)

    loss_fn = lambda lp: kl.kl_as_loss("k3-as-loss", lp, jnp.asarray(REF), jnp.asarray(MASK), clamp=1.0)  # noqa: E731
    np.testing.assert_allclose(loss_fn(jnp.asarray(LOGP)), np.minimum(k3, 1.0) * MASK, rtol=1e-5)
    expected = np.where(inside, -np.expm1(REF - LOGP), 0.0) * MASK
    np.testing.assert_allclose(_grad(loss_fn), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(kl.kl_coefficient("k3-as-loss", LOGP, REF, clamp=1.0),
                               np.where(inside, -np.expm1(REF - LOGP), 0.0), rtol=1e-5, atol=1e-7)


def test_k3_plus_clamp_clips_only_the_value():
    fn = lambda lp: kl.kl_as_loss("k3+-as-loss", lp, jnp.asarray(REF), jnp.asarray(MASK), clamp=1.0)  # noqa: E731
    np.testing.assert_allclose(fn(jnp.asarray(LOGP)), np.minimum(_np_k3(LOGP, REF), 1.0) * MASK, rtol=1e-5)
    np.testing.assert_allclose(_grad(fn), (LOGP - REF) * MASK, rtol=1e-6)


def test_verl_clamp_survives_overflow():
    """log_delta = 100 overflows exp in float32: verl's clamp 10 gives value 10 and a zero, finite gradient."""
    logp, ref = jnp.array([[-101.0, -1.0]]), jnp.array([[-1.0, -1.5]])
    value = kl.kl_k3(logp, ref, clamp=10.0)
    np.testing.assert_allclose(value, [[10.0, np.expm1(-0.5) + 0.5]], rtol=1e-6)
    grad = _grad(lambda lp: kl.kl_as_loss("k3-as-loss", lp, ref, jnp.ones((1, 2)), clamp=10.0), logp)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad, [[0.0, -np.expm1(-0.5)]], rtol=1e-6)
    # Unclamped, the same token's value is +inf: the clamp is what made it finite.
    assert np.isinf(np.asarray(kl.kl_k3(logp, ref))[0, 0])


@pytest.mark.parametrize("kind", ["k3-as-loss", "k3+-as-loss"])
def test_off_policy_form_with_clamp_matches_on_policy_gradient_at_ratio_one(kind):
    logp, ref, mask = jnp.asarray(LOGP), jnp.asarray(REF), jnp.asarray(MASK)
    on = _grad(lambda lp: kl.kl_as_loss(kind, lp, ref, mask, clamp=1.0))
    off = _grad(lambda lp: kl.kl_off_policy_token_loss(
        kind, lp, logp, ref, mask, eps_low=0.2, eps_high=0.2, clamp=1.0)[0])
    np.testing.assert_allclose(off, on, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- #
# Masks and errors
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kind, clamp", [("abs-as-loss", None), ("k3+-as-loss", None), ("k3+-as-loss", 1.0),
                                         ("k3-as-loss", 1.0)])
def test_masked_tokens_never_contribute(kind, clamp):
    off = MASK == 0
    junk_logp = jnp.asarray(np.where(off, -np.inf, LOGP))
    junk_ref = jnp.asarray(np.where(off, np.nan, REF))

    def run(lp, ref):
        fn = lambda x: kl.kl_as_loss(kind, x, ref, jnp.asarray(MASK), clamp=clamp)  # noqa: E731
        return fn(lp), jax.grad(lambda x: jnp.sum(fn(x)))(lp)

    base, poked = run(jnp.asarray(LOGP), jnp.asarray(REF)), run(junk_logp, junk_ref)
    for a, b in zip(base, poked, strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.all(np.isfinite(b)) and np.all(np.asarray(b)[off] == 0)


def test_jittable():
    fn = jax.jit(lambda lp, ref, m: kl.kl_as_loss("k3+-as-loss", lp, ref, m, clamp=10.0))
    np.testing.assert_allclose(fn(LOGP, REF, MASK), np.minimum(_np_k3(LOGP, REF), 10.0) * MASK, rtol=1e-5)


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda x: kl.kl_as_loss("k2-as-loss", x, x, x, clamp=10.0), ["clamp", "k2-as-loss", "k3-as-loss"]),
        (lambda x: kl.kl_coefficient("abs-as-loss", x, x, clamp=10.0), ["clamp", "abs-as-loss"]),
        (lambda x: kl.kl_k3(x, x, clamp=0.0), ["clamp", "> 0"]),
        (lambda x: kl.kl_k3(x, x, clamp=-1.0), ["clamp"]),
        (lambda x: kl.kl_k3(x, x, clamp="10"), ["clamp", "'10'"]),
        (lambda x: kl.kl_as_loss("k3", x, x, x), ["kind", "'k3'", "k3+-as-loss", "abs-as-loss"]),
        (lambda x: kl.kl_abs(x, x[:1]), ["ref_logp", "(1, 3)"]),
        (lambda x: kl.kl_off_policy_token_loss("minimax", x, x, x, x, eps_low=0.2, eps_high=0.2, clamp=1.0),
         ["clamp", "minimax"]),
    ],
)
def test_bad_input_names_the_argument(call, names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as err:
            call(jnp.ones((2, 3)))
    for name in names:
        assert name in str(err.value)
