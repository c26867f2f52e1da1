"""KL estimators and regularisers against the figures of docs/losses.md#kl-value-estimators,
closed-form gradients and exact expectations."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import kl, policy

V = 5  # a small categorical policy: exact expectations are sums over V outcomes
THETA = jnp.array([0.3, -1.2, 0.8, 0.0, -0.4])
REF_LOGP = jax.nn.log_softmax(jnp.array([0.1, 0.5, -0.3, 0.9, -1.0]))


def _gaussian_logpdf(x, mu, sigma):
    return -0.5 * ((x - mu) / sigma) ** 2 - np.log(sigma) - 0.5 * np.log(2 * np.pi)


def test_spec_gaussian_kl_example():
    mu, sigma = 0.1, 0.2
    true_kl = np.log(1 / sigma) + (sigma**2 + mu**2) / 2 - 0.5  # KL(N(mu, s^2) || N(0, 1))
    assert abs(true_kl - 1.1344) < 1e-4
    ratios = []
    for seed in range(5):
        x = np.random.default_rng(seed).normal(mu, sigma, 10_000)
        logq = jnp.asarray(_gaussian_logpdf(x, mu, sigma), jnp.float32)
        logp = jnp.asarray(_gaussian_logpdf(x, 0.0, 1.0), jnp.float32)
        k1 = np.asarray(kl.kl_k1(logq, logp))
        k3 = np.asarray(kl.kl_k3(logq, logp))
        # k1's std is ~0.68 (docs/losses.md#kl-value-estimators: "about 0.7"), so its mean
        # of 10,000 is within 4 sigma of 0.027.
        assert abs(k1.mean() - true_kl) < 0.03
        assert 0.6 < k1.std() < 0.8
        np.testing.assert_allclose(np.asarray(kl.kl_k2(logq, logp)), 0.5 * k1**2, rtol=1e-6)
        ratios.append(k3.std() / k1.std())
    # Measured ratios for seeds 0-4: 5.8, 7.2, 5.2, 8.2, 11.0 (variance is infinite since 0.2^2 < 1/2).
    assert min(ratios) > 3.0 and np.median(ratios) > 5.0, ratios


def _policy_logp(theta):
    return jax.nn.log_softmax(theta)


@functools.partial(jax.jit, static_argnums=0)
def _as_loss_grads(kind, ref_logp=REF_LOGP):
    """[V, V]: row y is grad_theta of the as-loss term for the sampled token y."""
    def grad_for(y):
        def loss(theta):
            lp = _policy_logp(theta)[y][None, None]
            return jnp.sum(kl.kl_as_loss(kind, lp, ref_logp[y][None, None], jnp.ones((1, 1))))
        return jax.grad(loss)(THETA)
    return jax.vmap(grad_for)(jnp.arange(V))


def _scores():
    """[V, V]: row y is the closed form grad_theta log softmax(theta)[y] = onehot(y) - softmax(theta)."""
    return np.eye(V) - np.asarray(jax.nn.softmax(THETA))[None]


def test_k2_as_loss_gradient_equals_k1_in_reward_gradient_on_policy():
    k1 = np.asarray(_policy_logp(THETA) - REF_LOGP)
    expected = k1[:, None] * _scores()  # the formula: c = log(pi/pi_ref) times the score
    np.testing.assert_allclose(_as_loss_grads("k2-as-loss"), expected, rtol=1e-5, atol=1e-7)

    # k1 in reward: the penalty shapes a zero reward into -k1, then the policy
    # loss at ratio 1 (old_logp = the same snapshot) carries it as an advantage.
    def reward_grad(y):
        def reward_loss(theta):
            lp = _policy_logp(theta)[y][None, None]
            shaped = kl.kl_in_reward(jnp.zeros((1, 1)), jax.lax.stop_gradient(lp), REF_LOGP[y][None, None],
                                     jnp.ones((1, 1)), coef=1.0)
            return jnp.sum(policy.ppo_clip_token_loss(lp, jax.lax.stop_gradient(lp), shaped, jnp.ones((1, 1)))[0])
        return jax.grad(reward_loss)(THETA)
    np.testing.assert_allclose(jax.jit(jax.vmap(reward_grad))(jnp.arange(V)), expected, rtol=1e-5, atol=1e-7)


def test_k1_as_loss_warns_ignores_ref_and_has_zero_mean_gradient():
    with pytest.warns(UserWarning, match="does not regularise"):
        grads = np.asarray(_as_loss_grads("k1-as-loss"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other_ref = np.asarray(_as_loss_grads("k1-as-loss", REF_LOGP[::-1] - 3.0))
    np.testing.assert_array_equal(grads, other_ref)
    np.testing.assert_allclose(grads, _scores(), atol=1e-6)
    pi = np.asarray(jax.nn.softmax(THETA))
    np.testing.assert_allclose(pi @ grads, np.zeros(V), atol=1e-6)  # exact expectation over y ~ pi


def test_k3_as_loss_coefficient_is_one_minus_delta():
    logp = jnp.linspace(-8.0, 0.0, 17)[None]
    ref = jnp.full_like(logp, np.log(0.25))
    grad = jax.grad(lambda lp: jnp.sum(kl.kl_as_loss("k3-as-loss", lp, ref, jnp.ones_like(lp))))(logp)
    expected = 1.0 - 0.25 / np.exp(np.asarray(logp, np.float64))
    np.testing.assert_allclose(grad, expected, rtol=1e-5)
    np.testing.assert_allclose(kl.kl_coefficient("k3-as-loss", logp, ref), expected, rtol=1e-5)
    # And k2's (= k1-in-reward's) coefficient is log(pi / pi_ref).
    np.testing.assert_allclose(kl.kl_coefficient("k2-as-loss", logp, ref), np.asarray(logp) - np.log(0.25), rtol=1e-5)


def test_minimax_coefficient_is_bounded_and_its_expected_gradient_is_the_mse_gradient():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.uniform(-40, 0, size=(4, 50)), jnp.float32)
    ref = jnp.asarray(rng.uniform(-40, 0, size=(4, 50)), jnp.float32)
    c = np.asarray(kl.kl_coefficient("minimax", logp, ref))
    assert np.all(c >= -1.0) and np.all(c <= 1.0)
    np.testing.assert_allclose(c, np.exp(np.asarray(logp)) - np.exp(np.asarray(ref)), atol=1e-7)
    extremes = kl.kl_coefficient("minimax", jnp.array([0.0, -jnp.inf]), jnp.array([-jnp.inf, 0.0]))
    np.testing.assert_array_equal(extremes, [1.0, -1.0])
    # Expectation over y ~ pi of the per-sample gradient = grad of 0.5 sum_y (pi(y) - pi_ref(y))^2 (appendix eq. 66).
    pi = np.asarray(jax.nn.softmax(THETA))
    expected_grad = pi @ np.asarray(_as_loss_grads("minimax"))
    mse_grad = jax.grad(lambda t: 0.5 * jnp.sum((jax.nn.softmax(t) - jnp.exp(REF_LOGP)) ** 2))(THETA)
    np.testing.assert_allclose(expected_grad, mse_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", kl.AS_LOSS_KINDS)
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_off_policy_kl_gradient_equals_on_policy_gradient_at_ratio_one(kind, policy_loss):
    rng = np.random.default_rng(1)
    logp = jnp.asarray(np.log(rng.uniform(0.01, 1, size=(3, 4))), jnp.float32)
    ref = jnp.asarray(np.log(rng.uniform(0.01, 1, size=(3, 4))), jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, size=(3, 4)), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on = jax.grad(lambda lp: jnp.sum(kl.kl_as_loss(kind, lp, ref, mask)))(logp)
        off = jax.grad(lambda lp: jnp.sum(kl.kl_off_policy_token_loss(
            kind, lp, logp, ref, mask, policy_loss=policy_loss, eps_low=0.2, eps_high=0.2)[0]))(logp)
    np.testing.assert_allclose(off, on, rtol=1e-5, atol=1e-7)


def test_off_policy_kl_is_importance_weighted_and_clipped():
    logp = jnp.log(jnp.array([[0.5, 0.5, 0.1, 0.1]]))
    old = jnp.log(jnp.array([[0.4, 0.2, 0.2, 0.05]]))  # ratios 1.25, 2.5, 0.5, 2.0
    ref = jnp.log(jnp.array([[0.25, 0.9, 0.9, 0.01]]))
    mask = jnp.ones((1, 4))
    grad = jax.grad(lambda lp: jnp.sum(kl.kl_off_policy_token_loss(
        "k2-as-loss", lp, old, ref, mask, eps_low=0.2, eps_high=0.3)[0]))(logp)
    ratio = np.array([1.25, 2.5, 0.5, 2.0])
    c = np.log(np.array([0.5, 0.5, 0.1, 0.1]) / np.array([0.25, 0.9, 0.9, 0.01]))  # the head's advantage is -c
    np.testing.assert_array_equal(np.sign(-c), [-1, 1, 1, -1])
    # Only token 1 (advantage > 0, ratio 2.5 > 1.3) is clipped; the others are importance weighted: rho * c.
    expected = np.where([False, True, False, False], 0.0, ratio * c)
    np.testing.assert_allclose(grad[0], expected, rtol=1e-5)


def test_kl_in_reward_token_and_sequence_forms():
    sample = jnp.array([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    ref = jnp.array([[-1.5, -1.0, -0.5], [-0.2, -9.0, -2.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 1]])
    k1 = np.asarray(sample - ref) * np.asarray(mask)
    token = kl.kl_in_reward(jnp.ones((2, 3)), sample, ref, mask, coef=0.1)
    np.testing.assert_allclose(token, 1.0 - 0.1 * k1, rtol=1e-6)
    seq = kl.kl_in_reward(jnp.array([1.0, 0.0]), sample, ref, mask, coef=0.1)
    np.testing.assert_allclose(seq, np.array([1.0, 0.0]) - 0.1 * k1.sum(1), rtol=1e-6)


@pytest.mark.parametrize(
    "call, names",
    [
        (lambda x: kl.kl_k1(x, x[:1]), ["ref_logp", "(1, 3)"]),
        (lambda x: kl.kl_k3(x.astype(jnp.int32), x), ["logp", "int32"]),
        (lambda x: kl.kl_coefficient("k4", x, x), ["kind", "k4", "k2-as-loss"]),
        (lambda x: kl.kl_as_loss("k1-in-reward", x, x, x), ["k1-in-reward", "kl_in_reward"]),
        (lambda x: kl.kl_as_loss("k2-as-loss", x, x, x[:, :2]), ["mask", "(2, 2)"]),
        (lambda x: kl.kl_in_reward(jnp.ones(3), x, x, x, coef=0.1), ["rewards", "(3,)"]),
        (lambda x: kl.kl_in_reward(jnp.ones(2), x, x, x, coef=-1.0), ["coef"]),
        (lambda x: kl.kl_off_policy_token_loss("k2-as-loss", x, x, x[0], x, eps_low=0.2, eps_high=0.2), ["ref_logp"]),
    ],
)
def test_bad_input_names_the_argument(call, names):
    with pytest.raises(ValueError) as err:
        call(jnp.ones((2, 3)))
    for name in names:
        assert name in str(err.value)
