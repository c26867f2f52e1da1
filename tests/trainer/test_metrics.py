"""Metrics log (JSONL + TensorBoard), resume truncation, and the end-of-run plots."""

import glob
import os
import struct

import numpy as np

from jaxrl.trainer.metrics import MetricsLogger, read_jsonl
from jaxrl.trainer.plots import fit_run_entropy_law, plot_run


def _tensorboard_scalars(folder) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in the event files, read as TFRecords (8-byte length,
    4-byte CRC, the Event proto, 4-byte CRC) with the format's own proto, not the writer's code."""
    from tensorboardX.proto import event_pb2

    found = []
    for path in sorted(glob.glob(str(folder / "events.out.tfevents.*"))):
        data, offset = open(path, "rb").read(), 0
        while offset < len(data):
            length = struct.unpack("<Q", data[offset:offset + 8])[0]
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 16 + length
            found += [(event.step, v.tag, round(v.simple_value, 6)) for v in event.summary.value]
    return found


def test_jsonl_tensorboard_and_resume_truncation(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=4, progress=False)
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": step / 10, "bad": float("nan"), "text": "skip me"})
    logger.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert rows == [{"step": s, "reward/mean": s / 10, "bad": None} for s in (1, 2, 3)]
    assert _tensorboard_scalars(tmp_path / "tb") == [(s, "reward/mean", s / 10) for s in (1, 2, 3)]
    # Resuming from step 2: step 3's line is dropped before new lines are appended.
    logger = MetricsLogger(str(tmp_path), total_steps=4, start_step=2, progress=False, tensorboard=False)
    logger.log(3, {"reward/mean": 0.9})
    logger.close()
    assert [r["reward/mean"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0.1, 0.2, 0.9]


def test_plots_and_entropy_law_ceiling(tmp_path):
    # Synthetic run obeying R = -a exp(H) + b with a = 0.5, b = 1.5: ceiling b - a = 1.0.
    entropy = np.linspace(1.0, 0.2, 20)
    rows = [{"step": i + 1, "recompute/entropy": float(h), "reward/mean": float(1.5 - 0.5 * np.exp(h)),
             "mismatch/k3": 1e-6, "heldout/reward": 0.5} for i, h in enumerate(entropy)]
    fit = fit_run_entropy_law(rows)
    assert abs(fit["a"] - 0.5) < 1e-4 and abs(fit["ceiling"] - 1.0) < 1e-4 and fit["fit_steps"] == 10
    assert fit_run_entropy_law(rows[:1]) is None
    paths = plot_run(rows, str(tmp_path / "plots"))
    assert set(paths) == {"reward", "entropy", "mismatch", "entropy_law"}
    for path in paths.values():
        assert os.path.getsize(path) > 1000
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_shows_the_step_reached(tmp_path, capsys):
    """Before: the bar advanced once per logged row, so the held-out evaluation logged at step 0
    made a 200-step demo end at "201it" past its total."""
    logger = MetricsLogger(str(tmp_path), total_steps=3, progress=True, tensorboard=False)
    logger.log(0, {"heldout/reward": 0.5})
    assert logger._bar.n == 0
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": 0.1})
    assert logger._bar.n == 3
    logger.close()
    assert "3/3" in capsys.readouterr().err
    # A resumed run's bar starts at the step it resumes from and ends at the total.
    logger = MetricsLogger(str(tmp_path), total_steps=3, start_step=2, progress=True, tensorboard=False)
    logger.log(3, {"reward/mean": 0.2})
    assert logger._bar.n == 3
    logger.close()
