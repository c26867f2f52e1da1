"""Asynchronous rollouts (``rollout.max_staleness``) through the trainer, on the embedded sampler:
the background path at staleness 0 is the synchronous loop, at staleness 1 every batch comes
from the weights one update older and the corrections see the engine's logprobs, and a resumed
asynchronous run reproduces the straight one."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.scoring import sequence_logprobs
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.rl import RLTrainer
from jaxrl.trainer.stages.rollout.queue import RolloutQueue

import test_loop
from test_loop import _comparable, _params, _run, make_config

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests


def test_background_generation_at_staleness_0_equals_the_synchronous_loop(files, tmp_path):
    """The worker-thread path with no lag (batch k drawn after the push of version k - 1,
    generated in the background) gives the synchronous run's parameters and metrics bit for bit."""
    _, straight = _run(make_config(files, tmp_path / "sync", steps=3))
    trainer = RLTrainer(make_config(files, tmp_path / "bg", steps=3))
    try:
        # Rebuild the queue with a worker (what max_staleness >= 1 uses), before anything was drawn.
        trainer.stage("rollout").queue.close()
        trainer.iterator.restore(trainer.stage("rollout").queue.state(0)["data"])
        trainer.stage("rollout").queue = RolloutQueue(trainer.iterator, trainer.stage("rollout").generate_pending, 0,
                                                     background=True)
        trainer.engine.update_weights(trainer.stage("push").engine_weights(), version="0")
        assert trainer.stage("push").copies_weights()
        trainer.stage("rollout").queue.fill(0)
        trainer.run()
        background = _params(trainer)
    finally:
        trainer.close()
    for a, b in zip(straight, background, strict=True):
        np.testing.assert_array_equal(a, b)
    rows = [_comparable(read_jsonl(str(tmp_path / name / "metrics.jsonl"))) for name in ("sync", "bg")]
    assert rows[0] == rows[1]


def test_staleness_1_samples_the_previous_weights_and_corrects_against_them(files, tmp_path):
    """max_staleness=1: step k's samples carry weight version max(k - 2, 0); their engine
    logprobs are those weights' (the learner's scoring with the parameters saved after step
    k - 2), the recompute is the current weights', so the mismatch metrics and the TIS weights
    measure the one-update lag rather than the float32 decode residual."""
    config = make_config(files, tmp_path / "run", steps=3, rollout={"max_staleness": 1},
                         objective={"mismatch_correction": "token-tis"})
    trainer = RLTrainer(config)
    taken = []
    take = trainer.stage("rollout").queue.take
    trainer.stage("rollout").queue.take = lambda index: taken.append(take(index)) or taken[-1]
    versions = [jax.device_get(trainer.state["params"])]
    try:
        assert trainer.stage("rollout").queue.background and trainer.stage("push").copies_weights()
        rows = []
        for _ in range(3):
            rows.append(trainer.train_step_once())
            versions.append(jax.device_get(trainer.state["params"]))
        graphdef = trainer.learner.train_step.graphdef
    finally:
        trainer.close()
    for k, batch in enumerate(taken, start=1):
        weights = max(k - 2, 0)
        assert {s.weight_version for group in batch.samples for s in group} == {str(weights)}, k
        assert rows[k - 1]["rollout/staleness_max"] == k - 1 - weights
        flat = [s for group in batch.samples for s in group]
        ids = np.zeros((len(flat), max(len(s.prompt_ids) + len(s.output_ids) for s in flat)), np.int32)
        lengths = np.asarray([len(s.prompt_ids) + len(s.output_ids) for s in flat], np.int32)
        for i, s in enumerate(flat):
            ids[i, :lengths[i]] = np.concatenate([s.prompt_ids, s.output_ids])
        scored = sequence_logprobs(nnx.merge(graphdef, versions[weights]), ids, lengths)
        for i, s in enumerate(flat):
            start = len(s.prompt_ids)
            np.testing.assert_allclose(s.output_logprobs, scored[i, start:lengths[i]], atol=2e-5)
    # Step 3 is the first that trains on a batch sampled one update before the learner's weights.
    assert rows[0]["mismatch/abs_log_ratio_max"] < 1e-4 and rows[1]["mismatch/abs_log_ratio_max"] > 1e-3
    assert rows[2]["mismatch/abs_log_ratio_max"] > 1e-3
    assert rows[2]["rollout/staleness_mean"] == 1.0


@pytest.mark.parametrize("staleness", [1, 2])
def test_resume_with_async_reproduces_the_straight_async_run(files, tmp_path, staleness):
    """4 steps straight == 2 steps, stop, resume to 4: the batches generated with weights the
    checkpoint does not hold travel in it, the next one is regenerated; same parameters, same metrics."""
    def config(name, steps):
        out = tmp_path / name
        return make_config(files, out, steps=steps, rollout={"max_staleness": staleness},
                           checkpoint={"every": 1, "keep": 2, "directory": str(out / "ck")})

    _, straight = _run(config("a", 4))
    _run(config("b", 2))
    _, resumed = _run(config("b", 4), resume=True)
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    rows = {name: _comparable(read_jsonl(str(tmp_path / name / "metrics.jsonl"))) for name in ("a", "b")}
    assert rows["a"] == rows["b"]
    assert [r["rollout/staleness_max"] for r in rows["a"]] == [min(k, staleness) for k in range(4)]


def test_max_staleness_is_validated(files, tmp_path):
    from jaxrl.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="rollout.max_staleness must be >= 0"):
        make_config(files, tmp_path, rollout={"max_staleness": -1})
