"""Trainer building blocks against hand-computed values: sequence packing, LR schedules, the CLI's config errors,
advantages with invalid samples."""

import math

import numpy as np
import pytest

from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.config import OptimizerConfig
from jaxrl.trainer.update import learning_rate_schedule


def test_pack_sequences_masks_only_completion_targets():
    out = StepBatch.pack([np.array([5, 6, 7]), np.array([8])], [np.array([9, 1]), np.array([2, 3, 1])], 6, 0,
                         rollout_logp=[np.array([-0.5, -0.25]), np.array([-1.0, -2.0, -3.0])])
    np.testing.assert_array_equal(out.input_ids, [[5, 6, 7, 9, 0, 0], [8, 2, 3, 0, 0, 0]])
    np.testing.assert_array_equal(out.targets, [[6, 7, 9, 1, 0, 0], [2, 3, 1, 0, 0, 0]])
    # Position t predicts targets[t]; only targets that are completion tokens count.
    np.testing.assert_array_equal(out.mask, [[0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out.segment_ids, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out.rollout_logp, [[0, 0, -0.5, -0.25, 0, 0], [-1, -2, -3, 0, 0, 0]])
    with pytest.raises(ValueError, match="sequence 0 has 5 tokens .* allows 4"):
        StepBatch.pack([np.array([5, 6, 7])], [np.array([9, 1])], 3, 0)


def test_schedules_match_closed_forms():
    cosine = learning_rate_schedule(OptimizerConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1), 110)
    assert float(cosine(0)) == 0.0
    assert float(cosine(5)) == pytest.approx(0.5)
    assert float(cosine(10)) == pytest.approx(1.0)
    # Halfway through the decay: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55.
    assert float(cosine(60)) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2, rel=1e-5)
    assert float(cosine(110)) == pytest.approx(0.1, rel=1e-5)
    constant = learning_rate_schedule(OptimizerConfig(lr=2.0, warmup_steps=4, schedule="constant"), 100)
    assert [float(constant(i)) for i in (0, 2, 4, 50)] == pytest.approx([0.0, 1.0, 2.0, 2.0])
    assert float(learning_rate_schedule(OptimizerConfig(lr=3e-4), 10)(0)) == pytest.approx(3e-4)


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    import os

    from jaxrl.trainer.cli import sft_main, train_main

    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    assert train_main([os.path.join(configs, "demo.yaml"), "rollout.group_sizes=4"]) == 2
    assert "unknown key rollout.group_sizes" in capsys.readouterr().err
    assert sft_main([os.path.join(configs, "demo_sft.yaml"), "sft.batch_size=0"]) == 2
    assert "sft.batch_size (0) must be >= 1" in capsys.readouterr().err


def test_invalid_samples_leave_their_group_baseline_and_the_zero_variance_count():
    from jaxrl.losses.advantages import AdvantageConfig, sequence_advantages

    # Two prompts, G = 3; sample 2 is invalid (unparsable). GRPO with the sample std (ddof=1):
    # group 0 over its valid [1, 0]: mean 1/2, std sqrt(1/2) -> +-1/sqrt(2);
    # group 1 [0, 1, 1]: mean 2/3, std sqrt(1/3) -> (r - 2/3) * sqrt(3).
    scores = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], np.float32)
    valid = np.array([True, True, False, True, True, True])
    adv, metrics = sequence_advantages(AdvantageConfig(), scores, valid, 3)
    s = math.sqrt(3.0)
    np.testing.assert_allclose(adv, [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, -2 / 3 * s, 1 / 3 * s, 1 / 3 * s],
                               rtol=1e-6)
    assert metrics == {"advantage/zero_variance_group_fraction": 0.0}
    # Group 0's valid samples agree (1, 1); the invalid 0 must not make it look informative.
    scores[1] = 1.0
    adv, metrics = sequence_advantages(AdvantageConfig(), scores, valid, 3)
    np.testing.assert_array_equal(adv[:3], [0.0, 0.0, 0.0])
    assert metrics == {"advantage/zero_variance_group_fraction": 0.5}
