"""Every objective option through the trainer: each run's update equals a hand-rolled step of the
loss library on the batch the trainer built, and the option visibly changes that step.

The hand-rolled step (``_hand_rolled``) recomputes the learner's logprobs with the model, calls
``losses.rl_objective`` with the run's ``ObjectiveConfig``, differentiates it with ``jax.grad``
and applies Adam written out in numpy (Kingma & Ba, Algorithm 1). Runs use ``lr = 1``,
``eps = 1`` and no clipping, so a parameter change is about the gradient itself (not its sign),
and two mini-batches per step (S = 2), so the second update sees a moved policy: ratios leave 1,
clips and the KL to the reference bite. Each test also checks its option's own effect: the
counterfactual step without the option moves the parameters elsewhere, by far more than the
tolerance.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import losses
from jaxrl.trainer.stages import advantage as advantage_stage
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.rl import RLTrainer
import test_loop
import toy_rewards
from test_loop import make_config

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests

LR, EPS = 1.0, 1.0
# The rollout samples at temperature 0.7 and reports the logprobs it sampled from: the engine and
# the learner then disagree as much as a real low-precision engine, so corrections have work to do.
MISMATCHED_ROLLOUT = {"temperature": 0.7, "logprob_kind": "processed"}


@dataclasses.dataclass
class Run:
    """What a run did: its config, per step the batch the update saw, whether it skipped, the
    scores and validity the advantages came from; the parameters before and after; the logged rows."""

    config: object
    graphdef: object
    initial: object
    final: object = None
    reference_after: object = None
    batches: list = dataclasses.field(default_factory=list)
    skips: list = dataclasses.field(default_factory=list)
    scores: list = dataclasses.field(default_factory=list)
    opt_state_before: list = dataclasses.field(default_factory=list)
    opt_state_after: object = None
    rows: list = dataclasses.field(default_factory=list)
    recomputes: int = 0
    greedy_scores: list = dataclasses.field(default_factory=list)
    greedy: list = dataclasses.field(default_factory=list)
    tokenizer: object = None


def _host(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def _run(files, out, monkeypatch, *, steps: int = 1, objective=None, advantage=None, rollout=None,
         update=None) -> Run:
    config = make_config(files, out, steps=steps, objective=objective or {}, advantage=advantage or {},
                         rollout=rollout or {}, update={"mini_batches": 2, **(update or {})},
                         optimizer={"lr": LR, "eps": EPS, "clip_norm": 0.0})
    trainer = RLTrainer(config)
    run = Run(config, trainer.learner.train_step.graphdef, _host(trainer.state["params"]), tokenizer=trainer.tokenizer)
    update_stage, recompute_stage, rollout_stage = (trainer.stage(name) for name in ("update", "recompute", "rollout"))
    original_update, original_advantages = update_stage.update, advantage_stage.advantages
    original_score, original_rollout = recompute_stage.scorer.score, rollout_stage.rollout_pending

    def update(batch, step, skip):
        run.batches.append(batch)
        run.skips.append(skip)
        run.opt_state_before.append(_host(trainer.state["opt_state"]))
        return original_update(batch, step, skip)

    def advantages(batch, scores, valid, config, objective, group_size, greedy_scores=None):
        run.scores.append((np.array(scores), np.array(valid)))
        run.greedy_scores.append(greedy_scores)
        return original_advantages(batch, scores, valid, config, objective, group_size, greedy_scores)

    def rollout(examples, seed, n, temperature=None):  # the stage's rollout_pending: samples once gathered
        pending = original_rollout(examples, seed, n, temperature)

        def gathered():
            samples = pending()
            if temperature == 0.0:
                run.greedy.append(([e.prompt_ids for e in examples], [group[0].output_ids for group in samples]))
            return samples

        return gathered

    def score(params, *inputs, **options):
        run.recomputes += 1
        return original_score(params, *inputs, **options)

    update_stage.update, recompute_stage.scorer.score, rollout_stage.rollout_pending = update, score, rollout
    monkeypatch.setattr(advantage_stage, "advantages", advantages)
    try:
        trainer.run()
        run.final = _host(trainer.state["params"])
        run.opt_state_after = _host(trainer.state["opt_state"])
        run.reference_after = None if trainer.learner.reference is None else _host(trainer.learner.reference)
    finally:
        trainer.close()
    run.rows = read_jsonl(str(out / "metrics.jsonl"))
    return run


def _model_logp(run: Run, params, tokens):
    return _logp(run.graphdef, run.config.update.logprob_chunk_size, params, tokens)


def _logp(graphdef, chunk_size: int, params, tokens):
    """The learner's per-token logprobs and entropies of ``tokens`` (a batch) under ``params``."""
    model = nnx.merge(graphdef, params)
    logp, entropy, _ = model.token_logprobs(*(jnp.asarray(x) for x in tokens.model_inputs()), chunk_size=chunk_size)
    return logp, entropy


def _mini_batches(run: Run, batch):
    count = run.config.update.mini_batches
    size = batch.rows // count
    for s in range(count):
        rows = slice(s * size, (s + 1) * size)
        yield s, jax.tree.map(lambda x, rows=rows: jnp.asarray(x[rows]), batch)


class NumpyAdam:
    """Adam written out in numpy, float64 moments (Kingma & Ba, Algorithm 1; no weight decay):
    ``p - lr * m_hat / (sqrt(v_hat) + eps)``."""

    def __init__(self, params, *, lr: float, b1: float, b2: float, eps: float):
        self.lr, self.b1, self.b2, self.eps, self.t = lr, b1, b2, eps, 0
        self.m = [np.zeros(np.shape(x), np.float64) for x in jax.tree.leaves(params)]
        self.v = [np.zeros(np.shape(x), np.float64) for x in jax.tree.leaves(params)]

    def step(self, params, grads):
        """``params`` after one step with ``grads`` (a pytree like ``params``), float32 leaves."""
        self.t += 1
        new = []
        for i, (p, g) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True)):
            g = np.asarray(g, np.float64)
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            m_hat, v_hat = self.m[i] / (1 - self.b1 ** self.t), self.v[i] / (1 - self.b2 ** self.t)
            new.append(jnp.asarray(np.asarray(p, np.float64) - self.lr * m_hat / (np.sqrt(v_hat) + self.eps),
                                   jnp.float32))
        return jax.tree.unflatten(jax.tree.structure(params), new)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size", "objective"))
def _library_grad(params, mini, key, *, graphdef, chunk_size: int, objective: losses.ObjectiveConfig):
    """``jax.grad`` of ``rl_objective`` on one mini-batch, one compiled program for every mini-batch of
    a run rather than op-by-op dispatch (measured: 86.9 -> 81.6 s for the policy-loss tests)."""

    def loss(p):
        logp, entropy = _logp(graphdef, chunk_size, p, mini)
        return losses.rl_objective(objective, logp, mini.old_logp, mini.advantages, mini.mask,
                                   rollout_logp=mini.rollout_logp, ref_logp=mini.ref_logp, entropy=entropy,
                                   normalizer=losses.loss_normalizer(objective.aggregation, mini.mask), key=key)[0]

    return jax.grad(loss)(params)


def _hand_rolled(run: Run, objective: losses.ObjectiveConfig | None = None):
    """The parameters after the run's updates, stepped here: ``rl_objective`` (with ``objective``,
    default the run's) on each mini-batch of each recorded batch, ``jax.grad``, then Adam in numpy."""
    objective = objective or run.config.objective
    o = run.config.optimizer
    params = jax.tree.map(jnp.asarray, run.initial)
    adam = NumpyAdam(params, lr=LR, b1=o.b1, b2=o.b2, eps=EPS)
    for step, (batch, skip) in enumerate(zip(run.batches, run.skips, strict=True), start=1):
        if skip:
            continue
        for s, mini in _mini_batches(run, batch):
            key = jax.random.fold_in(jax.random.key(run.config.seed), step * run.config.update.mini_batches + s)
            grads = _library_grad(params, mini, key, graphdef=run.graphdef,
                                  chunk_size=run.config.update.logprob_chunk_size, objective=objective)
            params = adam.step(params, grads)
    return _host(params)


def _change(before, after) -> np.ndarray:
    return np.concatenate([(np.asarray(b) - np.asarray(a)).ravel()
                           for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)])


def _assert_update_is_the_library_step(run: Run, without: dict | None = None) -> None:
    """The run's parameter change equals the hand-rolled one within float32 tolerance and, with
    ``without`` (ObjectiveConfig fields), differs from the counterfactual step by >= 30x that."""
    trained = _change(run.initial, run.final)
    expected = _change(run.initial, _hand_rolled(run))
    scale = float(np.max(np.abs(expected)))
    assert scale > 1e-3, "the step barely moved the parameters: nothing to compare"
    tolerance = 1e-4 * scale
    np.testing.assert_allclose(trained, expected, rtol=0, atol=tolerance)
    if without is not None:
        counterfactual = dataclasses.replace(run.config.objective, **without)
        other = _change(run.initial, _hand_rolled(run, counterfactual))
        assert float(np.max(np.abs(other - expected))) > 30 * tolerance, f"{without} changes nothing here"


def _last(run: Run, name: str) -> float:
    return run.rows[-1][name]


# ---------------------------------------------------------------- policy losses and clipping

# id -> (objective options, the counterfactual's changes)
POLICY_LOSS_RUNS = {
    "gspo": ({"policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4}, {"policy_loss": "ppo"}),
    # With one advantage per sequence (as the trainer's estimators give) GSPO-token's gradient is
    # GSPO's (Zheng et al. 2025, arXiv 2507.18071, sec. 4.3), so its counterfactual is PPO.
    "gspo-token": ({"policy_loss": "gspo-token", "eps_low": 3e-4, "eps_high": 4e-4}, {"policy_loss": "ppo"}),
    "tight-clip": ({"eps_low": 0.01, "eps_high": 0.01}, {"eps_low": 0.2, "eps_high": 0.28}),
    "cispo": ({"policy_loss": "cispo", "eps_low": 0.01, "eps_high": 0.01}, {"policy_loss": "ppo"}),
    "gmpo": ({"policy_loss": "gmpo", "eps_low": 0.01, "eps_high": 0.01}, {"policy_loss": "ppo"}),
    "reinforce": ({"policy_loss": "reinforce"}, {"policy_loss": "ppo", "eps_low": 0.01, "eps_high": 0.01}),
    "sapo": ({"policy_loss": "sapo"}, {"policy_loss": "ppo", "eps_low": 0.01, "eps_high": 0.01}),
    "seq-mean-token-mean": ({"aggregation": "seq-mean-token-mean"}, {"aggregation": "token-mean"}),
    "seq-mean-token-sum-norm": ({"aggregation": "seq-mean-token-sum-norm"}, {"aggregation": "token-mean"}),
}


@pytest.mark.parametrize("objective, without", list(POLICY_LOSS_RUNS.values()), ids=list(POLICY_LOSS_RUNS))
def test_policy_loss_options_update_as_the_library_does(files, tmp_path, monkeypatch, objective, without):
    run = _run(files, tmp_path, monkeypatch, objective=objective)
    _assert_update_is_the_library_step(run, without)
    if "eps_low" in objective:  # the clip bites on the second mini-batch's moved policy
        assert _last(run, "update/clip_frac") > 0


def test_every_policy_loss_is_tested_through_the_trainer():
    tested = {"ppo"} | {objective.get("policy_loss") for objective, _ in POLICY_LOSS_RUNS.values()} - {None}
    assert tested == set(losses.POLICY_LOSSES)


def test_dual_clip_bounds_negative_advantage_ratios(files, tmp_path, monkeypatch):
    run = _run(files, tmp_path, monkeypatch, objective={"eps_low": 0.01, "eps_high": 0.01, "dual_clip": 1.01})
    _assert_update_is_the_library_step(run, {"dual_clip": None})
    assert _last(run, "update/dual_clip_frac") > 0


# ---------------------------------------------------------------- the reference model and KL

def _assert_reference_is_the_initial_policy(run: Run) -> None:
    """The reference parameters never change and ``ref_logp`` is the initial policy's logprob."""
    for a, b in zip(jax.tree.leaves(run.initial), jax.tree.leaves(run.reference_after), strict=True):
        np.testing.assert_array_equal(a, b)
    for batch in run.batches:
        ref_logp, _ = _model_logp(run, jax.tree.map(jnp.asarray, run.initial), batch)
        m = np.asarray(batch.mask) > 0
        np.testing.assert_allclose(np.asarray(batch.ref_logp)[m], np.asarray(ref_logp)[m], atol=1e-5)


@pytest.mark.parametrize("objective", [
    {"kl_kind": "k2-as-loss"},
    {"kl_kind": "k3-as-loss"},
    {"kl_kind": "minimax"},
    {"kl_kind": "k3-as-loss", "kl_off_policy_correction": False},
    {"kl_kind": "k3+-as-loss"},
    {"kl_kind": "k3-as-loss", "kl_clamp": 0.05},
], ids=["k2", "k3", "minimax", "k3-on-policy-form", "k3+", "k3-clamped"])
def test_kl_as_loss_pulls_towards_a_frozen_reference(files, tmp_path, monkeypatch, objective):
    """The first mini-batch is at the reference (KL 0, no KL gradient); the second has moved, so
    the logged KL is positive and the step differs from the same step with kl_coef = 0 (and, for
    the clamp, from the unclamped step: clamped tokens lose their KL gradient)."""
    run = _run(files, tmp_path, monkeypatch, objective={**objective, "kl_coef": 1.0})
    _assert_update_is_the_library_step(run, {"kl_kind": "none", "kl_coef": 0.0, "kl_clamp": None})
    if "kl_clamp" in objective:
        _assert_update_is_the_library_step(run, {"kl_clamp": None})
    # k3 >= 0 token by token; k1's batch mean can be negative on samples of the old policy.
    assert _last(run, "update/kl_k3") > 1e-3
    if objective.get("kl_off_policy_correction") is False:  # the plain as-loss is k3's value, >= 0
        assert _last(run, "update/kl_loss") > 1e-3
    _assert_reference_is_the_initial_policy(run)


def test_abs_kl_pulls_with_the_sign_of_the_gap(files, tmp_path, monkeypatch):
    """abs-as-loss's coefficient is sgn(log pi - log pi_ref). On the first mini-batch the learner is
    the reference, and the sign of each token's gap is float rounding between the reference's
    forward and the train step's: no hand-rolled step can reproduce that, so this checks what is
    defined: a positive KL after the move, a frozen reference, and a step that is not the KL-free one
    (docs/losses.md#kl-regularisers says to prefer k2 or k3)."""
    run = _run(files, tmp_path, monkeypatch, objective={"kl_kind": "abs-as-loss", "kl_coef": 1.0})
    assert _last(run, "update/kl_k3") > 1e-3
    _assert_reference_is_the_initial_policy(run)
    trained = _change(run.initial, run.final)
    kl_free = _change(run.initial, _hand_rolled(run, dataclasses.replace(run.config.objective, kl_kind="none",
                                                                         kl_coef=0.0)))
    assert float(np.max(np.abs(trained - kl_free))) > 1e-2


def test_k1_in_reward_lowers_each_reward_by_its_kl(files, tmp_path, monkeypatch):
    """Step 2 samples from a moved policy: each sample's reward drops by exactly
    coef * sum_t (old_logp - ref_logp) over its tokens before GRPO sees it."""
    coef = 0.5
    run = _run(files, tmp_path, monkeypatch, steps=2, objective={"kl_kind": "k1-in-reward", "kl_coef": coef})
    _assert_update_is_the_library_step(run)
    _assert_reference_is_the_initial_policy(run)
    batch, (scores, valid) = run.batches[1], run.scores[1]
    mask = np.asarray(batch.mask)
    kl = ((np.asarray(batch.old_logp, np.float64) - np.asarray(batch.ref_logp, np.float64)) * mask).sum(axis=1)
    assert np.max(np.abs(kl)) > 1e-3  # the policy moved: the penalty is not zero
    shaped = scores - coef * kl
    groups = shaped.reshape(-1, run.config.rollout.group_size)
    expected = (groups - groups.mean(axis=1, keepdims=True)) / np.maximum(groups.std(axis=1, ddof=1, keepdims=True),
                                                                          run.config.advantage.std_min)
    np.testing.assert_allclose(np.asarray(batch.advantages)[mask > 0],
                               np.broadcast_to(expected.reshape(-1, 1), mask.shape)[mask > 0], atol=1e-5)
    assert valid.all()


# ---------------------------------------------------------------- bypass, corrections, filter

def test_bypass_uses_the_engines_logprobs_and_recomputes_nothing(files, tmp_path, monkeypatch):
    run = _run(files, tmp_path, monkeypatch, objective={"bypass": True}, rollout=MISMATCHED_ROLLOUT)
    batch = run.batches[0]
    np.testing.assert_array_equal(np.asarray(batch.old_logp), np.asarray(batch.rollout_logp))
    assert run.recomputes == 0 and "time/recompute" not in run.rows[0]
    _assert_update_is_the_library_step(run)
    # The learner's own logprobs would have given another step: bypass is not a no-op here.
    learner = jax.tree.map(jnp.asarray, run.initial)
    logp, _ = _model_logp(run, learner, batch)
    recomputed = dataclasses.replace(run, batches=[batch.replace(old_logp=np.asarray(logp))],
                                     config=dataclasses.replace(
                                         run.config, objective=dataclasses.replace(run.config.objective, bypass=False)))
    other = _change(run.initial, _hand_rolled(recomputed))
    assert float(np.max(np.abs(other - _change(run.initial, run.final)))) > 1e-3


CORRECTIONS = {
    "token-tis": ({"tis_cap": 1.0}, "token_tis_clipped_token_frac"),
    "seq-tis": ({"tis_cap": 1.0}, "seq_tis_clipped_seq_frac"),
    "token-mis": ({"mis_c_low": 2.0, "mis_c_high": 1.0}, "token_mis_masked_token_frac"),
    "seq-mis": ({"seq_mis_cap": 1.0}, "seq_mis_masked_seq_frac"),
    "geo-rs": ({"geo_rs_lower": 0.9, "geo_rs_upper": 1.1}, "geo_rs_masked_seq_frac"),
    "seq-mis-two-sided": ({"seq_mis_cap": 2.0, "seq_mis_lower": 1.0}, "seq_mis_masked_seq_frac"),
    "seq-kl-rs": ({"seq_kl_rs_threshold": 0.02}, "seq_kl_rs_masked_seq_frac"),
}


def test_icepop_is_token_mis_under_its_papers_name():
    assert losses.objective._CORRECTIONS["icepop"] is losses.objective._CORRECTIONS["token-mis"]


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_mismatch_correction_weights_the_step_as_logged(files, tmp_path, monkeypatch, name):
    """The logged clipped / masked fraction is the library's on the recorded batch, strictly
    between 0 and 1, and the step is the corrected library step."""
    options, fraction = CORRECTIONS[name]
    name = name.removesuffix("-two-sided")
    run = _run(files, tmp_path, monkeypatch, objective={"mismatch_correction": name, **options},
               rollout=MISMATCHED_ROLLOUT)
    _assert_update_is_the_library_step(run, {"mismatch_correction": "none", "seq_mis_lower": None})
    if "seq_mis_lower" in options:  # the lower bound rejects what the one-sided cap keeps
        _assert_update_is_the_library_step(run, {"seq_mis_lower": None})
    batch = run.batches[0]
    correct, keywords = losses.objective._CORRECTIONS[name]
    values = []
    for _, mini in _mini_batches(run, batch):
        _, _, metrics = correct(mini.old_logp, mini.rollout_logp, mini.mask,
                                **{k: getattr(run.config.objective, f) for k, f in keywords.items()})
        values.append(float(metrics[fraction]))
    assert 0 < np.mean(values) < 1
    assert _last(run, f"update/{fraction}") == pytest.approx(np.mean(values), abs=1e-6)


def _mini_batch_metrics(run: Run, name: str) -> list[float]:
    """The correction ``name``'s metrics (with the run's options) on each mini-batch of step 1."""
    correct, keywords = losses.objective._CORRECTIONS[name]
    return [correct(mini.old_logp, mini.rollout_logp, mini.mask,
                    **{k: getattr(run.config.objective, f) for k, f in keywords.items()})[2]
            for _, mini in _mini_batches(run, run.batches[0])]


def test_an_is_weight_and_a_rejection_combine(files, tmp_path, monkeypatch):
    """seq-TIS reweights, Geo-RS rejects: the step is the library's combined correction, unlike
    either alone, and both corrections' fractions are logged as the library computes them."""
    objective = {"mismatch_correction": "seq-tis", "tis_cap": 1.0, "mismatch_rejection": "geo-rs",
                 "geo_rs_lower": 0.9, "geo_rs_upper": 1.1}
    run = _run(files, tmp_path, monkeypatch, objective=objective, rollout=MISMATCHED_ROLLOUT)
    _assert_update_is_the_library_step(run, {"mismatch_rejection": "none"})
    _assert_update_is_the_library_step(run, {"mismatch_correction": "geo-rs", "mismatch_rejection": "none"})
    for name, fraction in (("seq-tis", "seq_tis_clipped_seq_frac"), ("geo-rs", "geo_rs_masked_seq_frac")):
        expected = np.mean([float(m[fraction]) for m in _mini_batch_metrics(run, name)])
        assert 0 < expected < 1
        assert _last(run, f"update/{fraction}") == pytest.approx(expected, abs=1e-6)


def test_is_batch_normalization_is_the_same_for_any_micro_batch_split(files, tmp_path, monkeypatch):
    """Token-TIS weights divided by their mini-batch mean: with 2 micro-batches the trainer's step
    is the hand-rolled whole-mini-batch step, and not the unnormalised one."""
    objective = {"mismatch_correction": "token-tis", "tis_cap": 1.5, "is_batch_normalize": True}
    run = _run(files, tmp_path, monkeypatch, objective=objective, rollout=MISMATCHED_ROLLOUT,
               update={"micro_batches": 2})
    _assert_update_is_the_library_step(run, {"is_batch_normalize": False})
    means = []
    for _, mini in _mini_batches(run, run.batches[0]):
        weight, _, _ = losses.token_tis(mini.old_logp, mini.rollout_logp, mini.mask, cap=1.5)
        m = np.asarray(mini.mask) > 0
        means.append(float(np.asarray(weight)[m].mean()))
    assert abs(np.mean(means) - 1) > 1e-3  # normalising changes the weights here
    assert _last(run, "update/is_batch_norm_factor") == pytest.approx(np.mean(means), rel=1e-5)


@pytest.mark.parametrize("threshold, skipped", [(1e-6, True), (1e6, False)], ids=["crossed", "not-crossed"])
def test_batch_filter_skips_the_whole_update(files, tmp_path, monkeypatch, threshold, skipped):
    run = _run(files, tmp_path, monkeypatch, objective={"batch_filter_threshold": threshold},
               rollout=MISMATCHED_ROLLOUT)
    batch = run.batches[0]
    _, metrics = losses.batch_filter(jnp.asarray(batch.old_logp), jnp.asarray(batch.rollout_logp),
                                     jnp.asarray(batch.mask), threshold=threshold, metric="mismatch_k3")
    row = run.rows[0]
    assert row["filter/value"] == pytest.approx(float(metrics["batch_filter_value"]), rel=1e-5)
    assert run.skips == [skipped] and row["update/skipped_total"] == int(skipped)
    if skipped:
        for a, b in zip(jax.tree.leaves(run.initial), jax.tree.leaves(run.final), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(run.opt_state_before[0]), jax.tree.leaves(run.opt_state_after), strict=True):
            np.testing.assert_array_equal(a, b)
    else:
        _assert_update_is_the_library_step(run)


# ---------------------------------------------------------------- entropy control

@pytest.mark.parametrize("objective", [
    {"entropy_control": "clip-cov", "clip_cov_ratio": 0.2, "clip_cov_omega_low": -10.0, "clip_cov_omega_high": 10.0},
    {"entropy_control": "kl-cov", "kl_cov_ratio": 0.2, "kl_cov_beta": 10.0},
], ids=["clip-cov", "kl-cov"])
def test_entropy_control_changes_the_step_as_the_library_does(files, tmp_path, monkeypatch, objective):
    run = _run(files, tmp_path, monkeypatch, objective=objective)
    _assert_update_is_the_library_step(run, {"entropy_control": "none"})
    prefix = objective["entropy_control"].replace("-", "_")
    assert _last(run, f"update/{prefix}_count") > 0


def test_entropy_bonus_raises_the_step_towards_higher_entropy(files, tmp_path, monkeypatch):
    run = _run(files, tmp_path, monkeypatch, objective={"entropy_coef": 0.1})
    _assert_update_is_the_library_step(run, {"entropy_coef": 0.0})
    assert _last(run, "update/entropy_loss") < 0


# ---------------------------------------------------------------- advantage estimators

def _expected_advantages(estimator: str, scores: np.ndarray, group_size: int, std_min: float, *,
                         lengths: np.ndarray, greedy: np.ndarray | None, passk_k: int) -> np.ndarray:
    """Closed forms (docs/losses.md#advantage-estimators) in numpy, every sample valid; the
    batch-normalised estimators keep their own tiny std floor (1e-6, population std)."""
    groups = scores.reshape(-1, group_size).astype(np.float64)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if estimator == "grpo":
        out = centred / np.maximum(groups.std(axis=1, ddof=1, keepdims=True), std_min)
    elif estimator == "dr_grpo":
        out = centred
    elif estimator == "rloo":  # r_i minus the mean of the other G - 1 samples
        out = centred * group_size / (group_size - 1)
    elif estimator == "reinforce":
        out = (groups - groups.mean()) / max(groups.std(), 1e-6)
    elif estimator == "reinforce_pp_baseline":
        out = (centred - centred.mean()) / max(centred.std(), 1e-6)
    elif estimator == "opo":  # the length-weighted group mean as the baseline
        weights = lengths.reshape(groups.shape).astype(np.float64)
        out = groups - (weights * groups).sum(axis=1, keepdims=True) / weights.sum(axis=1, keepdims=True)
    elif estimator == "remax":  # minus the greedy response's reward
        out = groups - greedy.reshape(-1, 1)
    elif estimator == "grpo_passk":  # only a unique best response learns: (best - second) / std
        out = np.zeros_like(groups)
        for g, r in enumerate(groups):
            order = np.argsort(-r)
            if r[order[0]] > r[order[1]]:
                out[g, order[0]] = (r[order[0]] - r[order[1]]) / max(r.std(ddof=1), std_min)
    else:  # passk (Pass@k Training): analytic advantages, a sample is correct when r > 0.5
        out = np.zeros_like(groups)
        n, k = group_size, passk_k
        for g, r in enumerate(groups):
            c = int((r > 0.5).sum())
            mean = 1 - math.comb(n - c, k) / math.comb(n, k)
            std = math.sqrt(mean * (1 - mean))
            if std > 0:
                negative = 1 - mean - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)
                out[g] = np.where(r > 0.5, (1 - mean) / std, negative / std)
    return out.reshape(-1)


ESTIMATOR_OPTIONS = {"grpo": {}, "dr_grpo": {}, "rloo": {}, "reinforce": {}, "reinforce_pp_baseline": {}, "opo": {},
                     "remax": {}, "grpo_passk": {}, "passk": {"passk_k": 2}}


def test_every_estimator_is_tested_through_the_trainer():
    # "gae" needs a critic: tests/trainer/test_critic.py runs it through the trainer.
    assert set(ESTIMATOR_OPTIONS) | {"gae"} == set(losses.advantages.ESTIMATOR_CHOICES)


def _greedy_continuation(run: Run, prompt, length: int) -> list[int]:
    """Argmax decoding with the initial model's full forward, token by token (no KV cache): each
    step scores a row right-padded to a fixed width (padding is another segment, so causal
    attention never sees it) and takes the argmax at the last real token."""
    model = nnx.merge(run.graphdef, jax.tree.map(jnp.asarray, run.initial))
    width = len(prompt) + length

    @jax.jit
    def next_token(ids, last):
        positions = jnp.arange(width, dtype=jnp.int32)[None]
        segments = (positions <= last).astype(jnp.int32)
        hidden = model(ids, positions, segments).hidden[0, last]
        return jnp.argmax(hidden @ model.lm_head_weight())

    tokens = [int(t) for t in prompt]
    for _ in range(length):
        ids = jnp.asarray([tokens + [0] * (width - len(tokens))], jnp.int32)
        tokens.append(int(next_token(ids, len(tokens) - 1)))
    return tokens[len(prompt):]


@pytest.mark.parametrize("estimator", list(ESTIMATOR_OPTIONS))
def test_advantage_estimator_reaches_the_update(files, tmp_path, monkeypatch, estimator):
    run = _run(files, tmp_path, monkeypatch, advantage={"estimator": estimator, **ESTIMATOR_OPTIONS[estimator]})
    batch, (scores, valid) = run.batches[0], run.scores[0]
    assert valid.all() and np.ptp(scores) > 0
    greedy = run.greedy_scores[0]
    if estimator == "remax":  # the baseline is the reward of the model's own greedy response
        prompts, outputs = run.greedy[0]
        assert len(outputs) == run.config.rollout.prompts_per_step
        for prompt, output, reward in zip(prompts, outputs, greedy, strict=True):
            assert list(output) == _greedy_continuation(run, prompt, len(output))[:len(output)]
            response = run.tokenizer.decode(output, skip_special_tokens=True)
            assert reward == pytest.approx(toy_rewards.digit_reward("", response, output, {}).score)
        assert run.rows[0]["advantage/greedy_reward_mean"] == pytest.approx(float(np.mean(greedy)))
    else:
        assert greedy is None and not run.greedy
    lengths = np.asarray(batch.generated).sum(axis=1)
    a = run.config.advantage
    expected = _expected_advantages(estimator, scores, run.config.rollout.group_size, a.std_min, lengths=lengths,
                                    greedy=None if greedy is None else np.asarray(greedy), passk_k=a.passk_k)
    assert np.max(np.abs(expected)) > 0
    mask = np.asarray(batch.mask)
    np.testing.assert_allclose(np.asarray(batch.advantages), expected[:, None] * mask, atol=1e-5)
    _assert_update_is_the_library_step(run)
