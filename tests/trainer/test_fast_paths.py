"""The trainer's fast paths, proven where users meet them: ``update.recompute_old_logp: when_needed``."""

import logging

import pytest

from jaxrl.models.scoring import LogprobScorer
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.rl import RLTrainer

import test_loop
import test_multiturn
from test_loop import _run, make_config

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests

KL = {"kl_kind": "k3-as-loss", "kl_coef": 0.04}


def _scorer_calls(monkeypatch) -> list[int]:
    """Counts the learner forwards of the recompute stage (old_logp and the reference's ref_logp)."""
    calls = []
    original = LogprobScorer.score

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LogprobScorer, "score", counted)
    return calls


def test_when_needed_skips_the_redundant_recompute_and_trains_as_the_recomputing_run(files, tmp_path,
                                                                                     monkeypatch):
    """Embedded sampler, one mini-batch, raw logprobs, a KL to the reference: with
    ``when_needed`` the recompute stage runs the reference's forward only (one scorer call per
    step, not two), the mismatch is still measured (on the update's first mini-batch), and the
    first update is the recomputing run's: the two differ only by old_logp = the sampler's
    logprobs, equal to the learner's up to the float32 decode residual (~1e-6 nats), so the PPO
    ratios are 1 up to that residual and loss and gradient norm agree to ~1e-6 relative."""
    rows = {}
    for mode in ("always", "when_needed"):
        calls = _scorer_calls(monkeypatch)
        _run(make_config(files, tmp_path / mode, steps=2, objective=KL, update={"recompute_old_logp": mode}))
        rows[mode] = read_jsonl(str(tmp_path / mode / "metrics.jsonl"))
        assert len(calls) == {"always": 4, "when_needed": 2}[mode], mode
        monkeypatch.undo()
    fast, slow = rows["when_needed"][0], rows["always"][0]
    assert "recompute/entropy" in slow and "recompute/entropy" not in fast  # no policy forward before the update
    assert fast["mismatch/num_tokens"] == slow["mismatch/num_tokens"] > 0
    assert fast["mismatch/abs_log_ratio_max"] < 1e-4 and slow["mismatch/abs_log_ratio_max"] < 1e-4
    for name in ("update/loss", "update/grad_norm", "update/kl_k3"):
        assert fast[name] == pytest.approx(slow[name], rel=1e-4, abs=1e-7), name
    assert fast["reward/mean"] == slow["reward/mean"]  # the same samples: same weights, same seeds


@pytest.mark.parametrize("change, reason", [
    ({"update": {"mini_batches": 2}}, "update.mini_batches=2"),
    ({"objective": {"mismatch_correction": "token-tis"}}, "learner-versus-engine ratio"),
    ({"objective": {"batch_filter_threshold": 1.0}}, "learner-versus-engine ratio"),
    ({"rollout": {"logprob_kind": "processed", "temperature": 0.7}}, "logprob_kind is not raw"),
    ({"rollout": {"max_staleness": 1}}, "rollout.max_staleness=1 (samples come from older weights)"),
    ({"rollout": {"partial_tokens": 2}}, "rollout.partial_tokens=2 (carried samples hold tokens of older weights)"),
    ({"logging": {"dump_batch_every": 1}}, "logging.dump_batch_every=1 (the dumped batches hold the learner's"),
    ({"model": {"architecture": {**test_loop.ARCHITECTURE, "mlp_types": ["moe"], "num_experts": 4,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 16}}},
     "the model has MoE layers (routing/disagreement"),
    ({"env": test_multiturn.ENV}, "env: conversations (mismatch_turn/*"),
])
def test_when_needed_keeps_the_recompute_where_it_is_needed(files, tmp_path, caplog, change, reason):
    """Later mini-batches and asynchronous rollouts are off-policy, corrections and the batch filter read the
    learner-versus-engine ratio, processed logprobs are not the learner's, an MoE model's and a
    conversation's recompute is also their check: each keeps the recompute (the objective is not
    switched to bypass) and the log says why."""
    sections = {"update": {"recompute_old_logp": "when_needed", **change.get("update", {})}}
    sections.update({k: v for k, v in change.items() if k != "update"})
    with caplog.at_level(logging.INFO, logger="jaxrl.trainer.rl"):
        trainer = RLTrainer(make_config(files, tmp_path / "run", **sections))
    try:
        assert not trainer.objective.bypass
        assert any("keeps the recompute" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    finally:
        trainer.close()


def test_when_needed_with_an_external_engine_keeps_the_recompute(files, tmp_path):
    """An engine handed to the trainer is not provably the learner's own arrays."""
    from jaxrl.rollout.sampler import JaxSampler

    config = make_config(files, tmp_path / "run", update={"recompute_old_logp": "when_needed"})
    probe = RLTrainer(config)
    engine = JaxSampler(probe.model(), max_cache_len=32)
    probe.close()
    trainer = RLTrainer(make_config(files, tmp_path / "run2", update={"recompute_old_logp": "when_needed"}),
                        engine=engine)
    try:
        assert not trainer.objective.bypass
    finally:
        trainer.close()


def test_jitted_step_statistics_equal_the_op_by_op_values():
    """The recompute stage's one jitted program (mismatch overall and by bucket, entropy) and the
    jitted advantage estimator give what the same library functions give op by op."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.losses import mismatch_metrics, mismatch_metrics_by_rollout_prob
    from jaxrl.losses.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, sequence_advantages
    from jaxrl.trainer.stages import recompute as recompute_stage

    rng = np.random.default_rng(0)
    old = np.log(rng.uniform(1e-6, 1.0, (8, 24))).astype(np.float32)
    rollout = (old + rng.normal(0, 0.05, old.shape)).astype(np.float32)
    mask = (rng.random(old.shape) < 0.7).astype(np.float32)
    entropy = rng.uniform(0, 3, old.shape).astype(np.float32)
    got = jax.device_get(recompute_stage._recompute_statistics(old, rollout, mask, entropy))
    with jax.disable_jit():
        pair = (jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(mask))
        eager = {"mismatch": mismatch_metrics(*pair), "buckets": mismatch_metrics_by_rollout_prob(*pair)}
    for group in ("mismatch", "buckets"):
        for key, value in eager[group].items():
            np.testing.assert_allclose(got[group][key], np.asarray(value), rtol=1e-5, atol=1e-7, err_msg=key)
    assert got["entropy"] == pytest.approx(float((entropy * mask).sum() / mask.sum()), rel=1e-6)

    scores = rng.integers(0, 2, 16).astype(np.float32)
    valid = rng.random(16) < 0.9
    jitted, _ = sequence_advantages(AdvantageConfig(estimator="grpo"), scores, valid, 4)
    with jax.disable_jit():
        eager_adv, _ = ADVANTAGE_ESTIMATORS["grpo"](jnp.asarray(scores), mask=jnp.asarray(valid), group_size=4,
                                                    std_min=0.1, std_max=1e6, ddof=1)
    np.testing.assert_allclose(jitted, np.asarray(eager_adv), rtol=1e-6, atol=1e-7)


COMPILE_CACHE_RUNS = """
import logging, os, sys
import jax
from jaxrl.trainer.model import use_compile_cache
from jaxrl.trainer.rl import RLTrainer
from test_loop import make_config, write_demo_files

root, cache = sys.argv[1], sys.argv[2]
assert use_compile_cache("") is None and not jax.config.jax_compilation_cache_dir  # "" turns it off
files = write_demo_files(os.path.join(root, "demo"), max_operand=10, heldout=10)
for run in ("first", "second"):
    logging.warning("RUN %s", run)
    trainer = RLTrainer(make_config(files, os.path.join(root, run), steps=1, compile_cache_dir=cache))
    trainer.run()
    trainer.close()
    jax.clear_caches()  # the second run starts as a new process would: nothing compiled in memory
"""


def test_compile_cache_dir_lets_a_rerun_load_its_programs(tmp_path):
    """``compile_cache_dir``: the first run compiles and stores its programs there; a second run of
    the same config (a rerun, or a resume) loads the sampler and the train step from it (JAX logs
    each persistent-cache hit with ``JAX_LOG_COMPILES``). Run in a process without the suite's
    own cache; JAX's threshold is lowered so the tiny model's programs are stored."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_LOG_COMPILES="1", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")]))
    cache = tmp_path / "cache" / "xla"
    done = subprocess.run([sys.executable, "-c", COMPILE_CACHE_RUNS, str(tmp_path), str(cache)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = done.stderr.split("RUN second")
    assert "RUN first" in first and "Persistent compilation cache hit" not in first
    for program in ("jit__generate", "jit__step"):
        assert f"Persistent compilation cache hit for '{program}'" in second, (program, second[-4000:])
    assert any(cache.iterdir())
