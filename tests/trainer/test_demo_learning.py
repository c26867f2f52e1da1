"""The demo's learning signal, shortened: SFT warm-up, then a few GRPO steps raise the held-out reward.

Fixed seeds make the run deterministic on one machine. The bound is loose (a few held-out
points) but a flipped gradient sign drives the reward down instead (checked by hand:
see the trainer report), so the assertion separates learning from its reverse.
"""

import pytest

from jaxrl.demo import run_rl, run_sft, write_demo_files

SFT_STEPS = 400
RL_STEPS = 40


@pytest.mark.slow
def test_grpo_raises_heldout_reward(tmp_path):
    root = str(tmp_path / "demo")
    write_demo_files(root, max_operand=10, heldout=20)
    quiet = ["logging.progress=false", "logging.tensorboard=false", "logging.plots=false"]
    run_sft(root, [f"sft.stages=[{{steps: {SFT_STEPS}, max_length: 16}}]", *quiet])
    summary = run_rl(root, [f"steps={RL_STEPS}", "rollout.prompts_per_step=16", "eval.samples=32",
                            "eval.every=0", "checkpoint.directory=", *quiet])
    start, end = summary["heldout_start"], summary["heldout_end"]
    print(f"held-out reward {start:.3f} -> {end:.3f}")
    assert 0.05 < start < 0.8  # SFT taught the format and left room to learn.
    # Measured: 0.300 -> 0.380 (jax 0.10.2, this CPU); earlier code gave 0.302 -> 0.450, and with the
    # advantages negated 0.302 -> 0.008.
    assert end >= start + 0.07
