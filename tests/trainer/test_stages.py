"""The step as a list of stages: their order, and a new stage added without touching the trainer.

A stage of the caller's, inserted through ``RLTrainer(extra_stages=...)`` (``build_stages``' extension
point), sees the record the stages before it filled, its metrics reach metrics.jsonl with its time,
and what it checkpoints comes back on ``--resume``.
"""

import numpy as np
import pytest

from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.rl import RLTrainer
from jaxrl.trainer.stages import Stage

import test_loop
from test_loop import make_config

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests

DATA_PATH = ["rollout", "reward", "pack", "recompute", "advantage", "filter", "update", "push"]


class LossTokens(Stage):
    """Counts the tokens that enter the loss, after the advantages are in; keeps how often it ran."""

    name = "loss_tokens"

    def __init__(self):
        self.calls = 0

    def __call__(self, record, step):
        assert record.batch.advantages is not None and record.batch.old_logp is not None
        self.calls += 1
        return record, {"loss_tokens/count": float(np.asarray(record.batch.mask).sum()),
                        "loss_tokens/calls": float(self.calls)}

    def checkpoint(self, step):
        return {"loss_tokens_calls": self.calls}

    def restore(self, meta, items):
        self.calls = meta["loss_tokens_calls"]


def test_the_stages_run_in_the_data_paths_order_and_a_new_one_needs_no_trainer_change(files, tmp_path):
    reward = {**test_loop.DENSE_REWARD, "mask_unparsable": False}
    config = dict(steps=2, reward=reward, checkpoint={"directory": str(tmp_path / "ck"), "every": 1})
    trainer = RLTrainer(make_config(files, tmp_path / "plain", steps=1, reward=reward))
    try:
        assert [s.name for s in trainer.stages] == DATA_PATH
    finally:
        trainer.close()
    trainer = RLTrainer(make_config(files, tmp_path / "run", **config), extra_stages=[("advantage", LossTokens())])
    try:
        assert [s.name for s in trainer.stages] == DATA_PATH[:5] + ["loss_tokens"] + DATA_PATH[5:]
        trainer.run()
    finally:
        trainer.close()
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    samples = 4 * 4  # prompts_per_step x group_size of make_config
    for step, row in enumerate(rows, start=1):
        # Every sample is valid, so the loss tokens are every generated token: the rollout stage's
        # mean response length times the samples.
        assert row["loss_tokens/count"] == pytest.approx(row["rollout/response_length_mean"] * samples)
        assert row["loss_tokens/calls"] == step and row["time/loss_tokens"] >= 0
    # Its checkpoint record comes back with the run's: the resumed stage counts on from 2.
    resumed = RLTrainer(make_config(files, tmp_path / "run", **{**config, "steps": 3}), resume=True,
                        extra_stages=[("advantage", LossTokens())])
    try:
        assert resumed.stage("loss_tokens").calls == 2
        assert resumed.train_step_once()["loss_tokens/calls"] == 3
    finally:
        resumed.close()


def test_a_stage_inserted_after_an_unknown_stage_is_refused_naming_the_stages(files, tmp_path):
    with pytest.raises(ValueError, match=r"cannot insert stage 'loss_tokens' after 'advantages': the stages are "
                                         r"\['rollout', 'reward', 'pack'"):
        RLTrainer(make_config(files, tmp_path, steps=1), extra_stages=[("advantages", LossTokens())])
