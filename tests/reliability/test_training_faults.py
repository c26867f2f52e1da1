"""Training must not silently break, and no run may be lost: one test per defect, in process.

Each docstring first states how the defect showed before the fix.
"""
import json
import logging
import os
import subprocess

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, from_dict, load_config
from jaxrl.rollout.base import PushVerificationError
from jaxrl.trainer.checkpoint import CheckpointSaveError
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.guard import NonFiniteUpdateError, UpdateGuard
from jaxrl.trainer.lifecycle import RunExistsError, clear_previous_run
from jaxrl.trainer.metrics import MetricsLogger, read_jsonl
from jaxrl.trainer.rl import RLTrainer
from jaxrl.trainer.sft import SFTTrainer


def _params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]


def _trainer(data, **kwargs):
    return RLTrainer(from_dict(TrainConfig, data), **kwargs)


# ------------------------------------------------------------------ configs refused at load
@pytest.mark.parametrize("override, key", [
    ("optimizer.lr=.nan", "optimizer.lr"),
    ("optimizer.lr=nan", "optimizer.lr"),
    ("objective.eps_high=.inf", "objective.eps_high"),
    ("advantage.std_max=-.inf", "advantage.std_max"),
])
def test_non_finite_numbers_are_refused_at_load(run_config, tmp_path, override, key):
    """Before: ``optimizer.lr=nan`` was accepted and trained to all-NaN weights with exit status 0."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps(run_config(tmp_path / "out")))
    with pytest.raises(ConfigError, match=f"{key}.*not a finite number"):
        load_config(TrainConfig, path, [override])


@pytest.mark.parametrize("section, values, message", [
    ("rollout", {"group_size": 1}, r"advantage.estimator='grpo'.*rollout.group_size=1"),
    ("rollout", {"temperature": -0.5}, r"rollout.temperature must be >= 0"),
    ("rollout", {"top_p": 0.0}, r"rollout.top_p must be in \(0, 1\]"),
    ("rollout", {"top_p": 1.5}, r"rollout.top_p must be in \(0, 1\]"),
    ("rollout", {"top_k": -1}, r"rollout.top_k must be >= 0"),
    ("rollout", {"max_new_tokens": 0}, r"rollout.max_new_tokens must be >= 1"),
    ("advantage", {"std_min": 0.0}, r"advantage.std_min \(0.0\) must be > 0"),
    ("advantage", {"std_min": 2.0, "std_max": 1.0}, r"advantage.std_min \(2.0\) must be > 0 and <= advantage.std_max"),
    ("update", {"max_consecutive_skips": 0}, r"update.max_consecutive_skips must be >= 1"),
    ("update", {"epochs": 0}, r"update.epochs \(0\) must be >= 1"),
    ("update", {"router_z_loss": -1.0}, r"update.router_z_loss must be >= 0"),
    ("update", {"share_prefix": True}, r"update.share_prefix lays each prompt out once in packed rows: set "
                                       r"update.pack: true"),
    ("rollout", {"max_extra_draws": -1}, r"rollout.max_extra_draws must be >= 0"),
    ("rollout", {"dynamic_sampling": True, "max_staleness": 1}, r"rollout.dynamic_sampling .* rollout.max_staleness=1"),
])
def test_configs_that_cannot_learn_are_refused_at_load(run_config, tmp_path, section, values, message):
    """Before: GRPO with group_size=1 trained on all-zero advantages without a word, and a bad
    temperature/top_p/max_new_tokens/std_min surfaced only after the model loaded and the first
    rollout ran (or never: std_min=0 divided zero-variance groups by zero)."""
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, run_config(tmp_path, **{section: values}))


def test_group_size_one_is_fine_for_a_batch_baseline(run_config, tmp_path):
    """The group check is specific: reinforce (batch baseline) with one sample per prompt learns."""
    from_dict(TrainConfig, run_config(tmp_path, rollout={"group_size": 1}, advantage={"estimator": "reinforce"}))


# ------------------------------------------------------------------ non-finite updates
def test_non_finite_update_is_skipped_then_the_run_stops(run_config, tmp_path):
    """Before: an update that made the parameters non-finite was applied: every later step trained
    NaN weights and the run ended with exit status 0.

    ``lr = 1e39`` is finite as a config value but overflows float32, so the first update would
    make every parameter infinite: it is skipped (parameters and optimizer state kept, counted),
    and ``update.max_consecutive_skips = 2`` skips in a row stop the run with an error naming the key.
    """
    trainer = _trainer(run_config(tmp_path, steps=4, optimizer={"lr": 1e39, "clip_norm": 0.0},
                                  update={"max_consecutive_skips": 2}))
    try:
        before = _params(trainer)
        with pytest.raises(NonFiniteUpdateError, match="update.max_consecutive_skips=2"):
            trainer.run()
        for a, b in zip(before, _params(trainer), strict=True):
            np.testing.assert_array_equal(a, b)
        assert int(trainer.state["step"]) == 0  # no optimizer step was taken
    finally:
        trainer.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1]  # step 2 raised before it was logged
    assert rows[0]["update/nonfinite"] == 1.0 and rows[0]["update/nonfinite_skips"] == 1.0


def test_a_critic_whose_updates_are_all_non_finite_stops_the_run(run_config, tmp_path):
    """Before: with ``advantage.estimator: gae`` and a critic learning rate that overflows float32
    every critic update was skipped (``critic/nonfinite`` 1 at every step), nothing said so, and
    the run ended with exit status 0 on a critic that never learned. Now the critic's own guard
    warns of each skip and stops the run after ``update.max_consecutive_skips``, naming
    ``critic.optimizer.lr``; the critic's parameters are its initial ones, and its counts are logged."""
    trainer = _trainer(run_config(tmp_path, steps=4, advantage={"estimator": "gae"},
                                  critic={"optimizer": {"lr": 1e39, "clip_norm": 0.0}},
                                  update={"max_consecutive_skips": 2}))
    try:
        before = [np.asarray(x) for x in jax.tree.leaves(trainer.stage("advantage").state["params"])]
        with pytest.raises(NonFiniteUpdateError, match=r"step 2: the critic's 2 optimizer updates in a row .*"
                                                       r"\(critic\.optimizer\.lr\)"):
            trainer.run()
        for a, b in zip(before, jax.tree.leaves(trainer.stage("advantage").state["params"]), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
        assert int(trainer.stage("advantage").state["step"]) == 0
    finally:
        trainer.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["critic/nonfinite"] == 1.0 and rows[0]["critic/nonfinite_skips"] == 1.0
    assert rows[0]["update/nonfinite_skips"] == 0.0  # the policy's updates were finite


def test_the_critics_guard_resumes_where_it_stopped(run_config, tmp_path):
    """Its counts travel in the checkpoint: a resumed run stops after the same skip in a row."""
    config = run_config(tmp_path, steps=1, advantage={"estimator": "gae"},
                        critic={"optimizer": {"lr": 1e39, "clip_norm": 0.0}}, update={"max_consecutive_skips": 2},
                        checkpoint={"directory": str(tmp_path / "ck")})
    trainer = _trainer(config)
    try:
        trainer.run()
    finally:
        trainer.close()
    trainer = _trainer({**config, "steps": 3}, resume=True)
    try:
        assert trainer.stage("advantage").guard.consecutive_skips == 1
        with pytest.raises(NonFiniteUpdateError, match="step 2: the critic's 2 optimizer updates"):
            trainer.run()
    finally:
        trainer.close()


def test_a_destructive_learning_rate_is_warned_about(run_config, tmp_path, caplog):
    """Before: ``optimizer.lr=1e6`` destroyed the model without a warning."""
    trainer = _trainer(run_config(tmp_path, steps=1, optimizer={"lr": 1e6}))
    try:
        with caplog.at_level(logging.WARNING, logger="jaxrl.trainer.rl"):
            trainer.run()
    finally:
        trainer.close()
    assert any("as large as the parameters (is optimizer.lr too high?)" in r.getMessage() for r in caplog.records)
    row = read_jsonl(str(tmp_path / "metrics.jsonl"))[0]
    assert row["update/spike_warnings"] == 1.0 and row["update/relative_size"] > 1.0


def test_a_normal_learning_rate_gives_no_spike_warning(run_config, tmp_path):
    """The detector is specific: the tiny run at lr=1e-2 trains without a warning."""
    trainer = _trainer(run_config(tmp_path, steps=2))
    try:
        trainer.run()
    finally:
        trainer.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["update/spike_warnings"] for r in rows] == [0.0, 0.0]
    assert all(r["update/relative_size"] < 1.0 for r in rows)


# ------------------------------------------------------------------ the push spot check
def _corrupt_engine_logprobs(monkeypatch, corrupt):
    """Makes the embedded sampler's samples go through ``corrupt(sample) -> sample``."""
    from jaxrl.rollout.sampler import JaxSampler

    generate = JaxSampler.generate

    def patched(self, prompts, params, n=1):
        return [[corrupt(s) for s in group] for group in generate(self, prompts, params, n=n)]

    monkeypatch.setattr(JaxSampler, "generate", patched)


def test_push_check_fails_on_nan_logprobs(run_config, tmp_path, monkeypatch):
    """Before: an engine reporting NaN logprobs passed the push check (``nan > tolerance`` is False)."""
    import dataclasses

    _corrupt_engine_logprobs(monkeypatch, lambda s: dataclasses.replace(
        s, output_logprobs=np.full_like(s.output_logprobs, np.nan)))
    trainer = _trainer(run_config(tmp_path, steps=1))
    try:
        with pytest.raises(PushVerificationError, match="differ from the learner's by up to nan"):
            trainer.run()
    finally:
        trainer.close()


def test_push_check_fails_when_it_compares_zero_tokens(run_config, tmp_path, monkeypatch):
    """Before: a batch with no generated token passed the push check: its max |dlogp| defaulted to 0."""
    import dataclasses

    _corrupt_engine_logprobs(monkeypatch, lambda s: dataclasses.replace(
        s, output_ids=s.output_ids[:0], output_logprobs=s.output_logprobs[:0]))
    trainer = _trainer(run_config(tmp_path, steps=1))
    try:
        with pytest.raises(PushVerificationError, match="compared zero generated tokens"):
            trainer.run()
    finally:
        trainer.close()


def test_push_check_under_bypass_uses_the_losss_tokens(run_config, tmp_path, monkeypatch):
    """With ``objective.bypass`` there is no recompute: the check reads the mismatch the loss
    measured on the first mini-batch. Clean logprobs pass (the tokens it compared are counted);
    NaN logprobs fail, as without bypass (before, ``nan > tolerance`` was False there too)."""
    import dataclasses

    data = run_config(tmp_path / "clean", steps=2, objective={"bypass": True})
    trainer = _trainer(data)
    try:
        trainer.run()
    finally:
        trainer.close()
    rows = read_jsonl(str(tmp_path / "clean" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2] and all(r["mismatch/num_tokens"] > 0 for r in rows)

    _corrupt_engine_logprobs(monkeypatch, lambda s: dataclasses.replace(
        s, output_logprobs=np.full_like(s.output_logprobs, np.nan)))
    trainer = _trainer(run_config(tmp_path / "nan", steps=1, objective={"bypass": True}))
    try:
        with pytest.raises(PushVerificationError, match="differ from the learner's by up to nan"):
            trainer.run()
    finally:
        trainer.close()


def test_a_step_with_every_sample_masked_out_of_the_loss_keeps_training(run_config, tmp_path):
    """Before: when every sample of a step was masked out after its reward (all unparsable, as a
    policy driven away from the answer format gives), the default run (``update.recompute_old_logp:
    when_needed`` skips the recompute, so the push check reads the loss's measurement) stopped with
    "the push check ... compared zero generated tokens", though the engine had generated them.

    The loss measured nothing on such a step, so that push goes unchecked, as in a step with no
    policy loss; an engine that returns no tokens at all still fails the check
    (``test_push_check_fails_when_it_compares_zero_tokens``)."""
    out = tmp_path / "masked"
    data = run_config(out, steps=3, reward={"mask_unparsable": True, "tasks": {"t": {
        "kind": "math", "answer_field": "answer"}}})
    trainer = _trainer(data)
    try:
        assert trainer.context.objective.bypass  # the default's fast path: no recompute
        trainer.run()
    finally:
        trainer.close()
    rows = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/unparsable_fraction"] == 1.0 and r["mismatch/num_tokens"] == 0 for r in rows), rows


# ------------------------------------------------------------------ never lose a run
def _snapshot(folder):
    """{relative path: (size, mtime_ns)} of every file under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            out[os.path.relpath(path, folder)] = (stat.st_size, stat.st_mtime_ns)
    return out


def test_a_fresh_start_never_destroys_an_earlier_run(run_config, tmp_path):
    """Before: starting again without --resume in a run's folders truncated its metrics.jsonl and
    mixed new checkpoints into the old ones.

    A fresh start over an earlier run (RL or SFT) is refused before any file changes; one that
    fails on a bad value touches nothing; ``overwrite=True`` starts afresh on purpose.
    """
    data = run_config(tmp_path / "run", steps=1, checkpoint={"directory": str(tmp_path / "run" / "ck"), "every": 1})
    trainer = _trainer(data)
    try:
        trainer.run()
    finally:
        trainer.close()
    before = _snapshot(tmp_path / "run")
    assert "metrics.jsonl" in before and any(p.startswith("ck/1/") for p in before)

    with pytest.raises(RunExistsError, match=r"metrics.jsonl.*checkpoint steps 1.*--resume.*--overwrite"):
        _trainer(data)
    sft = run_config(tmp_path / "run", steps=1, sft={"batch_size": 4, "stages": [{"steps": 1, "max_length": 16}]},
                     checkpoint={"directory": str(tmp_path / "run" / "ck")})
    with pytest.raises(RunExistsError):
        SFTTrainer(from_dict(TrainConfig, sft))
    with pytest.raises(Exception, match="tokenizer"):  # a bad value, with overwrite: still nothing touched
        _trainer(run_config(tmp_path / "run", steps=1, data={"tokenizer": str(tmp_path / "missing")},
                            checkpoint={"directory": str(tmp_path / "run" / "ck")}), overwrite=True)
    assert _snapshot(tmp_path / "run") == before

    trainer = _trainer(data, overwrite=True)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))] == [1]


def test_the_spike_check_survives_updates_with_zero_gradient():
    """Before: once the recent updates' median grad_norm was 0 (every token rejected by a
    mismatch correction, as Geo-RS under injected noise did), the next nonzero one raised
    ZeroDivisionError and ended the run."""
    warnings = []
    guard = UpdateGuard(max_consecutive_skips=3, spike_factor=10.0, warn=warnings.append)
    norms = [0.0] * 6 + [0.5]  # no scale from a zero median: no verdict on the 0.5
    norms += [0.5] * UpdateGuard.WINDOW + [50.0]  # the median is 0.5 again: 50 is a spike
    for step, grad_norm in enumerate(norms, start=1):
        guard.check(step, {"loss": 0.0, "grad_norm": grad_norm, "update/nonfinite": 0.0, "update/relative_size": 0.0})
    assert len(warnings) == 1 and "grad_norm 50 is 100x the median 0.5" in warnings[0]


def test_overwrite_says_it_deleted_a_run_only_when_there_was_one(tmp_path, caplog):
    """Before: every overwriting start warned "deleted the earlier run", fresh folders too
    (each cell of an experiment grid printed it)."""
    with caplog.at_level(logging.WARNING):
        clear_previous_run(str(tmp_path / "fresh"), "")
    assert not caplog.records
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    with caplog.at_level(logging.WARNING):
        clear_previous_run(str(tmp_path / "old"), "")
    assert [r.getMessage() for r in caplog.records] == [f"--overwrite: deleted the earlier run in {tmp_path / 'old'}"]
    assert not (tmp_path / "old" / "metrics.jsonl").exists()


def test_a_torn_metrics_line_never_blocks_resume(tmp_path, caplog):
    """Before: a half-written last line of metrics.jsonl (kill or full disk mid-write) made
    ``--resume`` fail with a JSONDecodeError."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING):
        logger = MetricsLogger(str(tmp_path), 5, start_step=2, progress=False, tensorboard=False)
        logger.log(3, {"loss": 0.125})
        logger.close()
    assert any("line 3 is not a complete JSON row" in r.getMessage() for r in caplog.records)
    assert read_jsonl(str(path)) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}, {"step": 3, "loss": 0.125}]


def _damage(folder, how):
    if how == "missing file":
        victim = max((os.path.join(r, f) for r, _, fs in os.walk(folder / "state") for f in fs), key=os.path.getsize)
        os.remove(victim)
    elif how == "truncated file":
        victim = max((os.path.join(r, f) for r, _, fs in os.walk(folder / "state") for f in fs), key=os.path.getsize)
        with open(victim, "r+b") as f:
            f.truncate(7)
    else:  # bad metadata
        (folder / "meta" / "metadata").write_text("{not json")


@pytest.mark.parametrize("how", ["missing file", "truncated file", "bad metadata"])
def test_resume_falls_back_from_a_damaged_checkpoint(run_config, tmp_path, caplog, how):
    """Before: a damaged latest checkpoint made ``--resume`` fail with an Orbax traceback, although
    an intact older checkpoint was there.

    The damaged step is reported with its path, moved aside, and the run resumes from the newest
    intact step; its metrics rows after that step are dropped and the run redoes them.
    """
    ck = tmp_path / "ck"
    data = run_config(tmp_path, steps=3, checkpoint={"directory": str(ck), "every": 1, "keep": 3})
    trainer = _trainer(data)
    try:
        trainer.run()
    finally:
        trainer.close()
    _damage(ck / "3", how)
    with caplog.at_level(logging.WARNING, logger="jaxrl.trainer.checkpoint"):
        trainer = _trainer(data, resume=True)
    try:
        assert trainer.step == 2
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert f"checkpoint {ck / '3'} is damaged" in messages and "resuming from step 2" in messages
        assert sorted(os.listdir(ck)) == ["1", "2", "3.damaged"]
        trainer.run()
    finally:
        trainer.close()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
    assert "3" in os.listdir(ck)


def _small_tmpfs(path) -> bool:
    """Mounts a 64 KiB tmpfs at ``path`` (True) where the machine allows it (root, no sandbox)."""
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("slow_write", [False, True], ids=["write", "write slower than a step"])
def test_a_failed_checkpoint_write_stops_the_run_by_the_next_save(run_config, tmp_path, monkeypatch,
                                                                  slow_write):
    """Before: an asynchronous save that failed (disk full) surfaced one checkpoint interval later,
    in a 500-line traceback, after the run had trained on without a checkpoint, and was reported
    under the next save's step.

    The checkpoint folder is a 64 KiB tmpfs, too small for one checkpoint of the tiny model
    (~180 KB with Adam's moments); where mounting is not allowed, Orbax's write raises ENOSPC.
    The run stops at the first step boundary after the background write fails, at the latest when
    the next save starts, with the folder, the failed save's step (2) and the cause in one line.
    ``slow write`` keeps the write "in progress" at every step boundary, as on a loaded machine:
    the failure surfaces when one of Orbax's threads has reported it (step 3's boundary, if it
    has by then) or when step 4's save starts.
    """
    import orbax.checkpoint as ocp

    ck = tmp_path / "ck"
    mounted = _small_tmpfs(ck)
    if not mounted:
        if slow_write:
            pytest.skip("a background write needs a small tmpfs, which this machine cannot mount")

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    if slow_write:
        monkeypatch.setattr(ocp.CheckpointManager, "is_saving_in_progress", lambda self: True)
    try:
        trainer = _trainer(run_config(tmp_path, steps=5, checkpoint={"directory": str(ck), "every": 2}))
        try:
            with pytest.raises(CheckpointSaveError,
                               match=rf"checkpoint of step 2 to {ck}.*No space left on device") as error:
                trainer.run()
        finally:
            trainer.close()
        assert "\n" not in str(error.value)
        steps = [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))]
        if slow_write:
            assert steps in ([1, 2, 3], [1, 2, 3, 4])
        else:
            assert steps in ([1, 2], [1, 2, 3], [1, 2, 3, 4])
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ck)], check=False)


@pytest.mark.parametrize("command", ["train", "sft"])
def test_train_without_arguments_prints_usage(command, capsys):
    """Before: ``jaxrl train`` alone said "the following arguments are required: config, overrides",
    as if overrides were required too."""
    from jaxrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: jaxrl {command}" in err and "optional key=value overrides" in err and "--overwrite" in err
