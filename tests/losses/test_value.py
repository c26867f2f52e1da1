"""The critic's losses (docs/losses.md#gae-with-a-critic) against closed forms written out in numpy:
the clipped value loss and its gradient, the explained variance, the whitening of GAE advantages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import losses
from jaxrl.losses.gae import whiten_advantages
from jaxrl.losses.value import clipped_value_loss, explained_variance

RNG = np.random.default_rng(0)
B, T = 4, 9
VALUES = RNG.normal(size=(B, T)).astype(np.float32)
OLD = (VALUES + RNG.normal(scale=0.4, size=(B, T))).astype(np.float32)
RETURNS = RNG.normal(size=(B, T)).astype(np.float32)
MASK = (RNG.random((B, T)) < 0.7).astype(np.float32)
MASK[0, :] = 0.0  # a sample with no token in the loss


def _np_value_loss(v, old, ret, mask, clip):
    """0.5 * max((V - R)^2, (clip(V, old - c, old + c) - R)^2) per token, and dl/dV by cases."""
    v, old, ret = (np.asarray(x, np.float64) for x in (v, old, ret))
    unclipped = (v - ret) ** 2
    if clip is None:
        return 0.5 * unclipped * mask, (v - ret) * mask, np.zeros_like(v, bool)
    clipped_v = np.minimum(np.maximum(v, old - clip), old + clip)
    clipped = (clipped_v - ret) ** 2
    loss = 0.5 * np.maximum(unclipped, clipped) * mask
    inside = (v > old - clip) & (v < old + clip)
    # The larger branch decides the gradient: the unclipped one's is V - R; the clipped one's is
    # V - R where the clip is the identity (V inside the range, where both branches are equal), 0
    # where it clamps V.
    grad = np.where(clipped > unclipped, np.where(inside, v - ret, 0.0), v - ret) * mask
    return loss, grad, (clipped > unclipped) & (mask > 0)


@pytest.mark.parametrize("clip", [0.2, 0.5, None])
def test_clipped_value_loss_and_gradient_match_the_closed_form(clip):
    want_loss, want_grad, clipped = _np_value_loss(VALUES, OLD, RETURNS, MASK, clip)
    loss, metrics = clipped_value_loss(jnp.asarray(VALUES), jnp.asarray(OLD), jnp.asarray(RETURNS),
                                       jnp.asarray(MASK), clip=clip)
    assert loss.dtype == jnp.float32 and loss.shape == (B, T)
    np.testing.assert_allclose(np.asarray(loss), want_loss, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda v: jnp.sum(clipped_value_loss(v, jnp.asarray(OLD), jnp.asarray(RETURNS),
                                                         jnp.asarray(MASK), clip=clip)[0]))(jnp.asarray(VALUES))
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
    live = MASK > 0
    assert float(metrics["vf_clip_frac"]) == pytest.approx(clipped.sum() / live.sum(), abs=1e-6)
    assert float(metrics["values_mean"]) == pytest.approx(VALUES[live].mean(), abs=1e-5)
    assert float(metrics["value_error"]) == pytest.approx(np.abs(VALUES - RETURNS)[live].mean(), abs=1e-5)
    if clip == 0.2:  # the test data exercises every case: V inside the range, clamped and deciding, clamped
        outside = (np.abs(VALUES - OLD) > clip) & live  # and not deciding (the unclipped error is larger)
        assert (live & ~outside).any() and (outside & clipped).any() and (outside & ~clipped).any()
        assert (want_grad[clipped] == 0).all()  # a larger clipped term has V clamped: no gradient


def test_masked_tokens_contribute_nothing_even_as_junk():
    junk = np.where(MASK > 0, VALUES, np.nan).astype(np.float32)
    old = np.where(MASK > 0, OLD, np.inf).astype(np.float32)
    ret = np.where(MASK > 0, RETURNS, -np.inf).astype(np.float32)

    def total(v):
        return jnp.sum(clipped_value_loss(v, jnp.asarray(old), jnp.asarray(ret), jnp.asarray(MASK), clip=0.2)[0])

    want_loss, want_grad, _ = _np_value_loss(VALUES, OLD, RETURNS, MASK, 0.2)
    assert float(total(jnp.asarray(junk))) == pytest.approx(want_loss.sum(), rel=1e-5)
    grad = np.asarray(jax.grad(total)(jnp.asarray(junk)))
    assert np.isfinite(grad).all() and (grad[MASK == 0] == 0).all()
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    _, metrics = clipped_value_loss(jnp.asarray(junk), jnp.asarray(old), jnp.asarray(ret), jnp.asarray(MASK), clip=0.2)
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_explained_variance_is_one_minus_the_residual_variance_share():
    live = MASK > 0
    r, v = RETURNS[live].astype(np.float64), VALUES[live].astype(np.float64)
    want = 1.0 - np.var(r - v) / np.var(r)
    got = explained_variance(jnp.asarray(RETURNS), jnp.asarray(VALUES), jnp.asarray(MASK))
    assert got.dtype == jnp.float32 and float(got) == pytest.approx(want, abs=1e-5)
    # A perfect critic explains everything, the mean return explains nothing, junk off the mask is ignored.
    junk = np.where(live, RETURNS, np.nan).astype(np.float32)
    assert float(explained_variance(jnp.asarray(junk), jnp.asarray(junk), jnp.asarray(MASK))) == pytest.approx(1.0)
    mean = np.full_like(RETURNS, r.mean())
    assert float(explained_variance(jnp.asarray(RETURNS), jnp.asarray(mean), jnp.asarray(MASK))) == pytest.approx(
        0.0, abs=1e-6)
    # The edges: constant returns (exactly predicted or not) and no token at all.
    ones = np.ones((2, 3), np.float32)
    assert float(explained_variance(jnp.asarray(ones), jnp.asarray(ones), jnp.ones((2, 3)))) == 1.0
    assert float(explained_variance(jnp.asarray(ones), jnp.asarray(RETURNS[:2, :3]), jnp.ones((2, 3)))) == 0.0
    assert float(explained_variance(jnp.asarray(ones), jnp.asarray(ones), jnp.zeros((2, 3)))) == 0.0


def test_whiten_advantages_over_the_masked_tokens():
    live = MASK > 0
    a = RETURNS[live].astype(np.float64)
    want = np.where(live, (RETURNS - a.mean()) / np.sqrt(a.var(ddof=1) + 1e-8), 0.0)  # verl's masked_whiten
    got = whiten_advantages(jnp.asarray(np.where(live, RETURNS, np.nan)), jnp.asarray(MASK))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    single = np.zeros((1, 3), np.float32)
    single[0, 1] = 1.0
    np.testing.assert_array_equal(np.asarray(whiten_advantages(jnp.full((1, 3), 5.0), jnp.asarray(single))), 0.0)


def test_library_exports_and_jit():
    assert losses.value.clipped_value_loss is clipped_value_loss
    jitted = jax.jit(lambda v, o, r, m: clipped_value_loss(v, o, r, m, clip=0.2))
    np.testing.assert_allclose(jitted(VALUES, OLD, RETURNS, MASK)[0], clipped_value_loss(VALUES, OLD, RETURNS, MASK)[0])


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda: clipped_value_loss(jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((2, 3)), jnp.ones((2, 3))),
         ["old_values", "(2, 4)"]),
        (lambda: clipped_value_loss(jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3))),
         ["values", "int32"]),
        (lambda: clipped_value_loss(jnp.ones(3), jnp.ones(3), jnp.ones(3), jnp.ones(3)), ["values", "rank 1"]),
        (lambda: clipped_value_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3)), clip=0.0),
         ["clip=0.0"]),
        (lambda: clipped_value_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3)),
                                    clip=float("nan")), ["clip=nan"]),
        (lambda: explained_variance(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((3, 3))), ["mask", "(3, 3)"]),
        (lambda: explained_variance(jnp.ones((2, 3)), jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3))),
         ["values", "int32"]),
        (lambda: whiten_advantages(jnp.ones((2, 3)), jnp.ones((2, 2))), ["mask", "(2, 2)"]),
        (lambda: whiten_advantages(jnp.ones((2, 3)), jnp.ones((2, 3)), eps=0.0), ["eps=0.0"]),
    ],
)
def test_bad_input_names_the_argument(call, names):
    with pytest.raises(ValueError) as err:
        call()
    for name in names:
        assert name in str(err.value)
