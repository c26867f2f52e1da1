"""The trainer's batch dump is what ``jaxrl align report`` reads, token-aligned with the learner."""

import numpy as np

from jaxrl.align.cli import main as align_main
from jaxrl.align.dump import AlignmentBatch
from jaxrl.models.scoring import sequence_logprobs
from jaxrl.trainer.rl import RLTrainer
import test_loop
from test_loop import make_config

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests


def test_dumped_batch_is_token_aligned_and_passes_the_checker(files, tmp_path):
    config = make_config(files, tmp_path / "run", steps=1,
                         logging={"progress": False, "tensorboard": False, "plots": False, "dump_batch_every": 1})
    dump_path = tmp_path / "run" / "batches" / "step-000001.npz"
    trainer = RLTrainer(config)
    seen = {}
    update = trainer.stage("update").update

    def score_then_update(batch, step, skip):
        # The dump is written before the update; score it with the checker's own token-aligned
        # recompute on the same (not yet updated) weights.
        dumped = AlignmentBatch.load(dump_path)
        seen["dumped"] = dumped
        seen["recomputed"] = sequence_logprobs(trainer.model(), dumped.token_ids, dumped.lengths)
        return update(batch, step, skip)

    trainer.stage("update").update = score_then_update
    try:
        trainer.run()
    finally:
        trainer.close()
    dumped, recomputed = seen["dumped"], seen["recomputed"]
    assert dumped.num_sequences == 4 * 4
    for i in range(dumped.num_sequences):  # model tokens start right after each prompt
        assert np.flatnonzero(dumped.model_mask[i])[0] == dumped.prompt_lengths[i]
    m = dumped.model_mask
    np.testing.assert_allclose(dumped.learner_logprobs[m], recomputed[m], atol=1e-5)
    np.testing.assert_allclose(dumped.rollout_logprobs[m], recomputed[m], atol=1e-4)
    assert align_main(["report", str(dump_path), "--out", str(tmp_path / "align"), "--max-k3", "1e-6"]) == 0
