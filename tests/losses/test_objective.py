"""The assembled objective: config validation, a numpy re-derivation, masks, micro-batches, composition."""

import dataclasses
import functools
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import losses
from jaxrl.config import from_dict
from jaxrl.losses import ObjectiveConfig, rl_objective

B, T = 8, 5


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 0.95, size=(B, T)))
    data = dict(
        logp=old + rng.normal(0, 0.3, size=(B, T)),
        old_logp=old,
        rollout_logp=old + rng.normal(0, 0.4, size=(B, T)),
        ref_logp=old + rng.normal(0, 0.5, size=(B, T)),
        advantages=rng.normal(size=(B, T)),
        entropy=rng.uniform(0.1, 2.0, size=(B, T)),
    )
    mask = (rng.uniform(size=(B, T)) < 0.7).astype(np.float32)
    mask[0] = 0.0  # a sequence without generated tokens
    data = {k: jnp.asarray(v, jnp.float32) for k, v in data.items()}
    data["mask"] = jnp.asarray(mask)
    return data


def _run(config, data, logp=None, **overrides):
    d = {**data, **overrides}
    return rl_objective(config, d["logp"] if logp is None else logp, d["old_logp"], d["advantages"], d["mask"],
                        rollout_logp=d["rollout_logp"], ref_logp=d["ref_logp"], entropy=d["entropy"],
                        normalizer=losses.loss_normalizer(config.aggregation, d["mask"]),
                        key=jax.random.key(0))


# Whole-program compilation: far cheaper than op-by-op dispatch for these many small ops.
@functools.partial(jax.jit, static_argnums=0)
def _loss_metrics_grad(config, data):
    (loss, metrics), grad = jax.value_and_grad(lambda lp: _run(config, data, logp=lp), has_aux=True)(data["logp"])
    return loss, metrics, grad


COMPOSITE = ObjectiveConfig(policy_loss="ppo", eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                            aggregation="seq-mean-token-mean", kl_kind="k2-as-loss", kl_coef=0.05,
                            kl_off_policy_correction=False, entropy_coef=0.01, mismatch_correction="token-tis",
                            tis_cap=2.0)


def test_composite_objective_against_numpy():
    data = _batch(1)
    n = {k: np.asarray(v, np.float64) for k, v in data.items()}
    m = n["mask"] > 0
    ratio = np.exp(n["logp"] - n["old_logp"])
    adv = n["advantages"]
    pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.28))
    pg = np.where(adv < 0, np.minimum(pg, -3.0 * adv), pg)
    weight = np.minimum(np.exp(n["old_logp"] - n["rollout_logp"]), 2.0)
    k2 = 0.5 * (n["logp"] - n["ref_logp"]) ** 2
    per_token = weight * pg + 0.05 * k2 - 0.01 * n["entropy"]
    seqs = [b for b in range(B) if m[b].any()]
    expected = sum(per_token[b][m[b]].mean() for b in seqs) / len(seqs)
    loss, metrics, grad = _loss_metrics_grad(COMPOSITE, data)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl_k1"], (n["logp"] - n["ref_logp"])[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["entropy"], n["entropy"][m].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["token_tis_clipped_token_frac"],
                               (np.exp(n["old_logp"] - n["rollout_logp"]) > 2.0)[m].mean(), rtol=1e-6)
    # d loss / d logp: (w * (-A rho) where the clips do not bind + coef * (logp - ref)) / (n_b S).
    binds = ((adv > 0) & (ratio > 1.28)) | ((adv < 0) & (ratio < 0.8)) | ((adv < 0) & (ratio > 3.0))
    per_token_grad = np.where(binds, 0.0, -weight * adv * ratio) + 0.05 * (n["logp"] - n["ref_logp"])
    scale = np.array([1 / (m[b].sum() * len(seqs)) if m[b].any() else 0.0 for b in range(B)])[:, None]
    np.testing.assert_allclose(grad, np.where(m, per_token_grad * scale, 0.0), rtol=1e-4, atol=1e-7)


CONFIGS = {
    "composite": COMPOSITE,
    "gspo-k3-offpolicy-seqtis": ObjectiveConfig(policy_loss="gspo", eps_low=0.01, eps_high=0.02, kl_kind="k3-as-loss",
                                                kl_coef=0.1, mismatch_correction="seq-tis", aggregation="token-mean"),
    "gspo-token-minimax-icepop": ObjectiveConfig(policy_loss="gspo-token", kl_kind="minimax", kl_coef=0.1,
                                                 mismatch_correction="icepop", aggregation="seq-mean-token-sum"),
    "ppo-geors-filter": ObjectiveConfig(mismatch_correction="geo-rs", geo_rs_lower=0.9, geo_rs_upper=1.1,
                                        batch_filter_threshold=0.05, aggregation="seq-mean-token-sum-norm"),
    "ppo-seqmis-k2off": ObjectiveConfig(mismatch_correction="seq-mis", kl_kind="k2-as-loss", kl_coef=0.1,
                                        entropy_coef=0.01),
    "clip-cov": ObjectiveConfig(entropy_control="clip-cov", clip_cov_ratio=0.5, clip_cov_omega_low=-10.0,
                                clip_cov_omega_high=10.0),
    "kl-cov": ObjectiveConfig(entropy_control="kl-cov", kl_cov_ratio=0.5, kl_cov_beta=1.0),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_masked_tokens_change_no_loss_metric_or_gradient(name):
    config, data = CONFIGS[name], _batch(2)
    hole = data["mask"] == 0

    base = _loss_metrics_grad(config, data)
    for field, junk in [("logp", 30.0), ("old_logp", -50.0), ("rollout_logp", 40.0), ("ref_logp", -jnp.inf),
                        ("advantages", 1e6), ("entropy", jnp.nan)]:
        loss, metrics, grad = _loss_metrics_grad(config, {**data, field: jnp.where(hole, junk, data[field])})
        assert float(loss) == float(base[0]), field
        assert metrics.keys() == base[1].keys()
        for k in metrics:
            np.testing.assert_array_equal(metrics[k], base[1][k], err_msg=f"{field} -> {k}")
        np.testing.assert_array_equal(grad, base[2], err_msg=field)


@pytest.mark.parametrize("name", ["composite", "gspo-k3-offpolicy-seqtis", "gspo-token-minimax-icepop",
                                  "ppo-geors-filter"])
def test_micro_batch_split_gives_identical_loss_and_gradient(name):
    config, data = CONFIGS[name], _batch(3)
    normalizer = losses.loss_normalizer(config.aggregation, data["mask"])

    @jax.value_and_grad
    def total(logp, splits):
        out = 0.0
        for idx in np.array_split(np.arange(B), splits):
            part = {k: v[idx] for k, v in data.items()}
            out = out + rl_objective(config, logp[idx], part["old_logp"], part["advantages"], part["mask"],
                                     rollout_logp=part["rollout_logp"], ref_logp=part["ref_logp"],
                                     entropy=part["entropy"], normalizer=normalizer)[0]
        return out

    (full, full_grad), *others = jax.jit(lambda lp: [total(lp, s) for s in (1, 2, 4)])(data["logp"])
    for loss, grad in others:
        np.testing.assert_allclose(loss, full, rtol=1e-6)
        np.testing.assert_allclose(grad, full_grad, rtol=1e-5, atol=1e-9)


def test_bypass_uses_rollout_logp_as_old_logp():
    data = _batch(4)
    normalizer = losses.loss_normalizer("token-mean", data["mask"])
    args = (data["logp"], None, data["advantages"], data["mask"])
    bypass, _ = rl_objective(ObjectiveConfig(bypass=True), *args, rollout_logp=data["rollout_logp"],
                             normalizer=normalizer)
    plain, _ = rl_objective(ObjectiveConfig(), data["logp"], data["rollout_logp"], data["advantages"], data["mask"],
                            normalizer=normalizer)
    assert float(bypass) == float(plain)
    with pytest.raises(ValueError, match="rollout_logp"):
        rl_objective(ObjectiveConfig(bypass=True), *args, normalizer=normalizer)


def test_clip_cov_detaches_and_kl_cov_adds_its_penalty():
    data = _batch(5)
    m = np.asarray(data["mask"]) > 0
    detach_all = ObjectiveConfig(entropy_control="clip-cov", clip_cov_ratio=1.0,
                                 clip_cov_omega_low=-1e9, clip_cov_omega_high=1e9)
    _, metrics, grad = _loss_metrics_grad(detach_all, data)
    np.testing.assert_array_equal(grad, np.zeros((B, T)))
    assert int(metrics["clip_cov_count"]) == m.sum()

    penalise_all = ObjectiveConfig(entropy_control="kl-cov", kl_cov_ratio=1.0, kl_cov_beta=0.5)
    gap = np.abs(np.asarray(data["logp"]) - np.asarray(data["old_logp"]))[m].mean()
    difference = _loss_metrics_grad(penalise_all, data)[0] - _loss_metrics_grad(ObjectiveConfig(), data)[0]
    np.testing.assert_allclose(difference, 0.5 * gap, rtol=1e-5)


def test_batch_filter_reports_skip():
    data = _batch(6)
    _, skip, _ = _loss_metrics_grad(ObjectiveConfig(batch_filter_threshold=0.0), data)
    _, keep, _ = _loss_metrics_grad(ObjectiveConfig(batch_filter_threshold=1e6), data)
    assert int(skip["batch_filter_skip"]) == 1 and int(keep["batch_filter_skip"]) == 0


def test_config_loads_from_a_mapping_and_validates():
    config = from_dict(ObjectiveConfig, {"policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4,
                                         "kl_kind": "k3-as-loss", "kl_coef": 0.001})
    assert config.policy_loss == "gspo" and config.kl_in_reward_coef == 0.0
    assert ObjectiveConfig(kl_kind="k1-in-reward", kl_coef=0.02).kl_in_reward_coef == 0.02
    with pytest.raises(ValueError, match="policy_loss"):
        from_dict(ObjectiveConfig, {"policy_loss": "ppo2"})
    with pytest.warns(UserWarning, match="does not regularise"):
        ObjectiveConfig(kl_kind="k1-as-loss", kl_coef=0.1)


def test_config_choices_are_the_registries():
    """The YAML loader reads the Literal annotations; the checks read the registries: they agree."""
    hints = typing.get_type_hints(ObjectiveConfig)
    registries = {
        "policy_loss": tuple(losses.policy.POLICY_LOSSES),
        "aggregation": losses.aggregation.AGGREGATION_MODES,
        "kl_kind": ("none",) + losses.kl.KL_REGULARIZERS,
        "entropy_control": losses.objective.ENTROPY_CONTROLS,
        "mismatch_correction": losses.objective.MISMATCH_CORRECTIONS,
    }
    for field, names in registries.items():
        assert typing.get_args(hints[field]) == names, field
    assert losses.objective.KL_KINDS == registries["kl_kind"]


def test_icepop_is_token_mis():
    data = _batch(2)
    token_mis = _run(ObjectiveConfig(mismatch_correction="token-mis", mis_c_low=1.5, mis_c_high=1.5), data)
    icepop = _run(ObjectiveConfig(mismatch_correction="icepop", mis_c_low=1.5, mis_c_high=1.5), data)
    assert float(token_mis[0]) == float(icepop[0])
    assert float(icepop[1]["token_mis_masked_token_frac"]) > 0


@pytest.mark.parametrize(
    "fields, names",
    [
        ({"policy_loss": "grpo"}, ["ObjectiveConfig.policy_loss", "'grpo'", "gspo-token"]),
        ({"aggregation": "mean"}, ["ObjectiveConfig.aggregation", "token-mean"]),
        ({"kl_kind": "k4"}, ["ObjectiveConfig.kl_kind", "k2-as-loss"]),
        ({"entropy_control": "cov"}, ["ObjectiveConfig.entropy_control", "clip-cov"]),
        ({"mismatch_correction": "tis"}, ["ObjectiveConfig.mismatch_correction", "token-tis"]),
        ({"batch_filter_metric": "k3"}, ["ObjectiveConfig.batch_filter_metric", "mismatch_k3"]),
        ({"eps_low": 1.5}, ["ObjectiveConfig.eps_low", "1.5"]),
        ({"eps_high": "0.2"}, ["ObjectiveConfig.eps_high", "number"]),
        ({"dual_clip": 0.9}, ["ObjectiveConfig.dual_clip"]),
        ({"kl_coef": 0.1}, ["ObjectiveConfig.kl_coef", "kl_kind"]),
        ({"clip_cov_omega_low": 6.0}, ["ObjectiveConfig.clip_cov_omega_low", "clip_cov_omega_high"]),
        ({"bypass": True, "mismatch_correction": "token-tis"}, ["ObjectiveConfig.bypass", "mismatch_correction"]),
        ({"bypass": 1}, ["ObjectiveConfig.bypass", "bool"]),
        ({"tis_cap": 0.0}, ["ObjectiveConfig.tis_cap"]),
    ],
)
def test_bad_config_names_the_field(fields, names):
    with pytest.raises(ValueError) as err:
        ObjectiveConfig(**fields)
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "config, drop, names",
    [
        (ObjectiveConfig(mismatch_correction="token-tis"), "rollout_logp", ["rollout_logp"]),
        (ObjectiveConfig(kl_kind="k2-as-loss", kl_coef=0.1), "ref_logp", ["ref_logp", "k2-as-loss"]),
        (ObjectiveConfig(entropy_coef=0.1), "entropy", ["entropy"]),
        (ObjectiveConfig(), "old_logp", ["old_logp"]),
    ],
)
def test_missing_inputs_are_named(config, drop, names):
    data = _batch(7)
    data[drop] = None
    with pytest.raises(ValueError) as err:
        _run(config, data)
    for name in names:
        assert name in str(err.value)


def test_clip_cov_without_key_and_mismatched_shapes_are_named():
    data = _batch(8)
    with pytest.raises(ValueError, match="key"):
        rl_objective(ObjectiveConfig(entropy_control="clip-cov"), data["logp"], data["old_logp"],
                     data["advantages"], data["mask"], normalizer=1.0)
    with pytest.raises(ValueError, match=r"ref_logp has shape \(8, 4\)"):
        _run(ObjectiveConfig(), data, ref_logp=data["ref_logp"][:, :4])
    with pytest.raises(ValueError, match="ObjectiveConfig"):
        rl_objective(dataclasses.asdict(COMPOSITE), data["logp"], data["old_logp"], data["advantages"],
                     data["mask"], normalizer=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid config and call emit no warning
        _run(COMPOSITE, data)
