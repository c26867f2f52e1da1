"""A run that stops learning says so: a rejection that drops most of the batch step after step, a batch
with nothing to learn from (one reward per group) or a held-out reward already at its maximum; and
Geo-RS's default band lets the demo learn.

Before: in the three committed mismatch experiments (docs/experiments/mismatch/report.md) Geo-RS's band
[0.999, 1.001] dropped nearly every sequence of the demo's short responses and the held-out reward collapsed
(0.013 under noise, against 0.260 uncorrected), while the terminal and the final summary said nothing.

The runs use configs/demo.yaml with a random model of the demo's architecture and the format reward
"starts with a digit", which a random model meets about half of the time (so samples are parsable and
enter the loss).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from flax import nnx

from jaxrl.config import load_config
from jaxrl.losses.objective import ObjectiveConfig
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.learning_watch import MOST, NEARLY_ALL, STEPS_IN_A_ROW, LearningWatch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "configs", "demo.yaml")
STEPS = 4
FRACTION = "update/geo_rs_masked_token_frac"
VERL_BAND = (0.999, 1.001)  # the band Geo-RS defaulted to before (verl's decoupled_geo_rs preset)


@pytest.fixture(scope="module")
def demo_overrides(tmp_path_factory) -> list[str]:
    """The demo's data and tokenizer, a random model of its architecture, and the tiny run's overrides."""
    from jaxrl.demo import write_demo_files
    from jaxrl.models import Decoder, ModelConfig, save_hf_checkpoint

    root = tmp_path_factory.mktemp("demo")
    paths = write_demo_files(str(root))
    with open(os.path.join(REPO, "configs", "demo_sft.yaml")) as f:
        architecture = yaml.safe_load(f)["model"]["architecture"]
    save_hf_checkpoint(Decoder(ModelConfig(**architecture), rngs=nnx.Rngs(0)), str(root / "hf"))
    return [f"model.hf_path={root / 'hf'}", f"data.tokenizer={paths['tokenizer']}",
            f"data.train_files=[{paths['train']}]", "data.eval_files=[]", f"steps={STEPS}",
            "rollout.prompts_per_step=8", "checkpoint.directory=", "logging.progress=false",
            "logging.plots=false", "logging.tensorboard=false",
            'reward.tasks={math: {kind: format, pattern: "^[0-9]"}}', "objective.mismatch_correction=geo-rs"]


# ------------------------------------------------------------------ the rule
def _watch(**objective):
    warnings = []
    return LearningWatch.for_objective(ObjectiveConfig(**objective), warnings.append), warnings


def test_the_rule_warns_once_per_streak_of_steps_that_drop_most_tokens():
    """Before: nothing watched the rejected fractions. Now three steps in a row above one half warn,
    once per streak; exactly one half, a break or a short streak do not; a step without the metric (no
    update) neither extends nor ends a streak."""
    assert (MOST, STEPS_IN_A_ROW) == (0.5, 3)
    watch, warnings = _watch(mismatch_correction="geo-rs", geo_rs_lower=0.9, geo_rs_upper=1.2)
    fractions = {1: 0.9, 2: 0.9, 3: 0.5, 4: 0.6, 5: 0.7, 6: None, 7: 0.8, 8: 0.9, 9: 0.1, 10: 0.95}
    for step, fraction in fractions.items():
        watch.observe(step, {} if fraction is None else {FRACTION: fraction})
    # Steps 1-2: two only; step 3: exactly one half; steps 4, 5, 7, 8 a streak (6 has no update); 10 alone.
    assert warnings == [
        "step 7: warning: objective.mismatch_correction=geo-rs dropped more than 50% of the tokens on each of "
        "steps 4-7 (60%, 70%, 80%; update/geo_rs_masked_token_frac): the update learns from what is left, so "
        "the run may barely learn. Loosen objective.geo_rs_lower (now 0.9), objective.geo_rs_upper (now 1.2) "
        "(docs/losses.md#mismatch-corrections), or set another objective.mismatch_correction"]
    mean = (0.6 + 0.7 + 0.8 + 0.9) / 4
    assert watch.add_to({}) == {"rejection_warnings": [
        f"objective.mismatch_correction=geo-rs dropped more than 50% of the tokens on steps 4-8 (mean {mean:.0%}; "
        "update/geo_rs_masked_token_frac). Loosen objective.geo_rs_lower (now 0.9), objective.geo_rs_upper "
        "(now 1.2) (docs/losses.md#mismatch-corrections), or set another objective.mismatch_correction"]}


def test_the_rule_watches_each_rejection_and_the_batch_filter_but_no_is_weight():
    """Before: a batch filter skipping every update was as silent as a rejection. Now with seq-TIS +
    seq-MIS only the rejection is watched (clipping drops nothing), the batch filter's skipped steps
    count as dropping the whole batch, and an IS weight alone leaves the summary as it was."""
    watch, warnings = _watch(mismatch_correction="seq-tis", mismatch_rejection="seq-mis", batch_filter_threshold=0.1)
    for step in (1, 2, 3):
        watch.observe(step, {"update/seq_tis_clipped_token_frac": 1.0, "update/seq_mis_masked_token_frac": 0.99,
                             "filter/skip": 1.0})
    assert len(warnings) == 2
    assert warnings[0].startswith("step 3: warning: objective.mismatch_rejection=seq-mis dropped more than 50%")
    assert "objective.seq_mis_cap (now 2.0), objective.seq_mis_lower (now None)" in warnings[0]
    assert warnings[1].startswith("step 3: warning: the batch filter (mismatch_k3 above "
                                  "objective.batch_filter_threshold) dropped more than 50% of the tokens on each "
                                  "of steps 1-3 (100%, 100%, 100%; filter/skip)")
    assert "Raise objective.batch_filter_threshold (now 0.1)" in warnings[1]
    assert len(watch.add_to({})["rejection_warnings"]) == 2
    only_is, warnings = _watch(mismatch_correction="token-tis")
    for step in (1, 2, 3, 4):
        only_is.observe(step, {"update/token_tis_clipped_token_frac": 1.0})
    assert warnings == [] and only_is.add_to({"metrics": "m"}) == {"metrics": "m"}


ZERO_VARIANCE = "advantage/zero_variance_group_fraction"
NOTHING_TO_LEARN = (
    "rollout.group_size samples of a prompt got one reward in more than 95% of the groups on {steps} ({shares}"
    "advantage/zero_variance_group_fraction)")


def test_the_rule_warns_when_nearly_every_group_has_one_reward_or_the_heldout_starts_at_the_top():
    """Before: a reward that never varies (too easy, too hard, a constant function) trained to the end with
    zero gradients and exited 0 in silence. Now more than 95% constant groups three steps in a row warn, and
    a held-out reward starting at 1.0 does; exactly 95% and a start below 1.0 do not."""
    assert NEARLY_ALL == 0.95
    watch, warnings = _watch()
    watch.observe_start({"heldout/reward": 0.999})
    for step, fraction in {1: 1.0, 2: 0.95, 3: 1.0, 4: 0.97, 5: 1.0}.items():
        watch.observe(step, {ZERO_VARIANCE: fraction})
    assert len(warnings) == 1 and warnings[0].startswith(
        "step 5: warning: " + NOTHING_TO_LEARN.format(steps="each of steps 3-5", shares="100%, 97%, 100%; "))
    assert "their advantages are zero" in warnings[0] and "jaxrl filter" in warnings[0]
    watch.observe_start({"heldout/reward": 1.0})
    assert warnings[1].startswith("step 0: warning: the held-out reward starts at 1.000, the built-in rewards' "
                                  "maximum: RL has nothing left to gain")
    lines = watch.add_to({})
    assert list(lines) == ["nothing_to_learn"] and len(lines["nothing_to_learn"]) == 2
    assert lines["nothing_to_learn"][0].startswith(NOTHING_TO_LEARN.format(steps="steps 3-5",
                                                                           shares="mean 99%; "))


# ------------------------------------------------------------------ through the trainer
def test_a_reward_that_never_varies_is_said_on_the_terminal_and_in_the_summary(demo_overrides, tmp_path):
    """Every response matches the format pattern "^", so every sample scores 1: the held-out reward starts
    at 1.0 and every group is constant on every step."""
    out = tmp_path / "out"
    heldout = next(o for o in demo_overrides if o.startswith("data.train_files=")).replace(
        "data.train_files=", "data.eval_files=").replace("train.jsonl", "heldout.jsonl")
    jaxrl = os.path.join(os.path.dirname(sys.executable), "jaxrl")
    done = subprocess.run([jaxrl, "train", DEMO, *demo_overrides, f"output_dir={out}", heldout, "eval.max_prompts=8",
                           'reward.tasks={math: {kind: format, pattern: "^"}}'],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row[ZERO_VARIANCE] for row in read_jsonl(str(out / "metrics.jsonl")) if ZERO_VARIANCE in row] == \
        [1.0] * STEPS
    assert done.stdout.count("step 3: warning: " + NOTHING_TO_LEARN.format(
        steps="each of steps 1-3", shares="100%, 100%, 100%; ")) == 1
    assert done.stdout.count("step 0: warning: the held-out reward starts at 1.000") == 1
    summary = json.loads(done.stdout[done.stdout.rindex("\n{") + 1:])
    assert len(summary["nothing_to_learn"]) == 2 and "rejection_warnings" not in summary


def test_a_band_that_rejects_everything_is_said_on_the_terminal_and_in_the_summary(demo_overrides, tmp_path):
    """Before: ``jaxrl train`` dropping every token of every step exited 0 with nothing on the terminal
    and a summary without a word of it. The band here excludes 1 (the embedded sampler matches the
    learner to float32 rounding, so every geometric-mean ratio is about 1): now the terminal warns once,
    at step 3, and the printed summary repeats it for steps 1-4."""
    out = tmp_path / "out"
    jaxrl = os.path.join(os.path.dirname(sys.executable), "jaxrl")
    done = subprocess.run([jaxrl, "train", DEMO, *demo_overrides, f"output_dir={out}", "objective.geo_rs_lower=1.5",
                           "objective.geo_rs_upper=2"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [row for row in read_jsonl(str(out / "metrics.jsonl")) if FRACTION in row]
    assert [row[FRACTION] for row in rows] == [1.0] * STEPS
    warning = ("step 3: warning: objective.mismatch_correction=geo-rs dropped more than 50% of the tokens on each "
               "of steps 1-3 (100%, 100%, 100%; update/geo_rs_masked_token_frac)")
    assert done.stdout.count(warning) == 1
    assert "Loosen objective.geo_rs_lower (now 1.5), objective.geo_rs_upper (now 2.0)" in done.stdout
    summary = json.loads(done.stdout[done.stdout.rindex("\n{") + 1:])
    assert summary["rejection_warnings"] == [
        "objective.mismatch_correction=geo-rs dropped more than 50% of the tokens on steps 1-4 (mean 100%; "
        "update/geo_rs_masked_token_frac). Loosen objective.geo_rs_lower (now 1.5), objective.geo_rs_upper "
        "(now 2.0) (docs/losses.md#mismatch-corrections), or set another objective.mismatch_correction"]


def _kept_token_fraction(batch, lower: float, upper: float) -> float:
    """Closed form of Geo-RS on a dumped batch: the share of generated tokens in sequences whose mean
    token log ratio (learner - engine) lies in [log lower, log upper]."""
    mask = batch["model_mask"].astype(bool)
    log_ratio = np.where(mask, batch["learner_logprobs"] - batch["rollout_logprobs"], 0.0).astype(np.float64)
    tokens = mask.sum(axis=1)
    mean = log_ratio.sum(axis=1) / np.maximum(tokens, 1)
    inside = (mean >= np.log(lower)) & (mean <= np.log(upper))
    return float((tokens * inside).sum() / tokens.sum())


def test_the_default_geo_rs_band_keeps_most_tokens_under_the_mismatch_experiments_noise(demo_overrides, tmp_path):
    """Before: the default band [0.999, 1.001] kept a minority of the demo's tokens under the mismatch
    experiment's noisy engine (configs/experiments/mismatch.yaml). Now the default keeps most tokens on
    every step (the logged metric, equal to the closed form on the dumped batches) and nothing is warned,
    while the old band would have kept only a minority of the same batches."""
    from jaxrl.models import make_mesh
    from jaxrl.rollout.mismatch import MismatchEngine
    from jaxrl.trainer.config import TrainConfig
    from jaxrl.trainer.model import build_model
    from jaxrl.trainer.rl import RLTrainer

    with open(os.path.join(REPO, "configs", "experiments", "mismatch.yaml")) as f:
        noise = dict(yaml.safe_load(f)["injection"]["noise"]["engine"])
    out = tmp_path / "out"
    config = load_config(TrainConfig, DEMO, [*demo_overrides, f"output_dir={out}", "rollout.verify_push=false",
                                             "logging.dump_batch_every=1"])
    mesh = make_mesh(config.mesh)
    engine = MismatchEngine(build_model(config.model, mesh), noise.pop("kind"), mesh=mesh,
                            max_batch=config.rollout.prompts_per_step * config.rollout.group_size, **noise)
    trainer = RLTrainer(config, engine=engine)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
        engine.close()
    assert "rejection_warnings" not in summary
    logged_kept = [1.0 - row[FRACTION] for row in read_jsonl(str(out / "metrics.jsonl")) if FRACTION in row]
    batches = [np.load(out / "batches" / f"step-{step:06d}.npz") for step in range(1, STEPS + 1)]
    default = (config.objective.geo_rs_lower, config.objective.geo_rs_upper)
    np.testing.assert_allclose(logged_kept, [_kept_token_fraction(b, *default) for b in batches], atol=1e-6)
    verl_kept = [_kept_token_fraction(b, *VERL_BAND) for b in batches]
    print(f"kept token fraction per step: default band {default}: {np.round(logged_kept, 3).tolist()}; "
          f"band {VERL_BAND}: {np.round(verl_kept, 3).tolist()}")
    assert min(logged_kept) > 0.5
    assert max(verl_kept) < 0.5
