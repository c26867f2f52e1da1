"""Metrics log (JSONL + TensorBoard), resume truncation, the progress, held-out completions, and the
end-of-run plots."""

import glob
import os
import struct
import sys

import numpy as np

from jaxrl.trainer.metrics import MetricsLogger, read_jsonl
from jaxrl.trainer.plots import MIN_LAW_POINTS, fit_run_entropy_law, law_equation, plot_run


def _summaries(folder, kind: str):
    """(step, summary value) of every value of ``kind`` ("simple_value": a scalar, "tensor": a text) in the
    event files, read as TFRecords (8-byte length, 4-byte CRC, the Event proto, 4-byte CRC) with the
    format's own proto, not the writer's code."""
    from tensorboardX.proto import event_pb2

    for path in sorted(glob.glob(str(folder / "events.out.tfevents.*"))):
        data, offset = open(path, "rb").read(), 0
        while offset < len(data):
            length = struct.unpack("<Q", data[offset:offset + 8])[0]
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 16 + length
            yield from ((event.step, v) for v in event.summary.value if v.WhichOneof("value") == kind)


def _tensorboard_scalars(folder) -> list[tuple[int, str, float]]:
    return [(step, v.tag, round(v.simple_value, 6)) for step, v in _summaries(folder, "simple_value")]


def _tensorboard_texts(folder) -> list[tuple[int, str, str]]:
    return [(step, v.tag, v.tensor.string_val[0].decode()) for step, v in _summaries(folder, "tensor")]


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
    assert not fit["ceiling_beyond_range"]
    # Fewer than MIN_LAW_POINTS fitted steps (half of the logged ones): no fit, no plot.
    assert MIN_LAW_POINTS == 8 and fit_run_entropy_law(rows[:15]) is None and fit_run_entropy_law(rows[:16])
    paths = plot_run(rows, str(tmp_path / "plots"))
    assert set(paths) == {"reward", "entropy", "mismatch", "entropy_law"}
    for path in paths.values():
        assert os.path.getsize(path) > 1000
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_law_is_written_with_its_signs_and_a_ceiling_past_the_rewards_is_flagged():
    """Before: a negative fitted a read "R = --0.2 exp(H)" in the plot's title and the demo's line, and a
    predicted ceiling of 1.22 for a 0-1 reward went unremarked."""
    assert law_equation(0.5, 1.5) == "R = -0.5 exp(H) + 1.5"
    assert law_equation(-0.2, -0.1) == "R = +0.2 exp(H) - 0.1"
    entropy = np.linspace(1.0, 0.2, 20)
    rows = [{"step": i + 1, "recompute/entropy": float(h), "reward/mean": float(2.0 - 0.5 * np.exp(h))}
            for i, h in enumerate(entropy)]
    fit = fit_run_entropy_law(rows)
    assert abs(fit["ceiling"] - 1.5) < 1e-4 and fit["ceiling_beyond_range"]


def test_rl_health_panel_and_sft_loss_plot(tmp_path):
    """An RL run gets health.png (loss, gradient norm, clip fraction, KL, response length), an SFT run
    loss.png; neither gets the other's."""
    rl = [{"step": s, "update/loss": 0.1 / s, "update/grad_norm": 1.0, "update/clip_frac": 0.01,
           "update/kl_k3": 1e-3 * s, "rollout/response_length_mean": 5.0 + s, "reward/mean": 0.1 * s}
          for s in range(1, 6)]
    paths = plot_run(rl, str(tmp_path / "rl"))
    assert "health" in paths and "loss" not in paths and os.path.getsize(paths["health"]) > 5000
    sft = [{"step": s, "update/loss": 1.0 / s, "update/nll": 1.1 / s, "sft/stage": 0} for s in range(1, 6)]
    paths = plot_run(sft, str(tmp_path / "sft"))
    assert "loss" in paths and "health" not in paths and os.path.getsize(paths["loss"]) > 5000


def test_held_out_completions_go_to_jsonl_and_tensorboard_text(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=4, progress=False)
    shown = [{"prompt": "1+2=", "response": "3 | x", "reward": 1.0, "task": "math"},
             {"prompt": "2+2=", "response": "5", "reward": 0.0, "task": "math"}]
    logger.completions(0, shown)
    logger.completions(2, shown[:1])
    logger.completions(4, [])  # nothing to show: nothing written
    logger.close()
    rows = read_jsonl(str(tmp_path / "completions.jsonl"))
    assert rows == [{"step": 0, **shown[0]}, {"step": 0, **shown[1]}, {"step": 2, **shown[0]}]
    texts = _tensorboard_texts(tmp_path / "tb")
    tag = "heldout/completions/text_summary"  # tensorboardX names a text summary so
    assert [(step, t) for step, t, _ in texts] == [(0, tag), (2, tag)]
    assert texts[0][2].splitlines()[0] == "prompt | response | reward | task"
    assert texts[0][2].splitlines()[2] == "1+2= | 3 \\| x | 1.0 | math"
    # A resume from step 1 drops step 2's completions, as it drops step 2's metrics.
    MetricsLogger(str(tmp_path), total_steps=4, start_step=1, progress=False, tensorboard=False).close()
    assert [row["step"] for row in read_jsonl(str(tmp_path / "completions.jsonl"))] == [0, 0]


def test_progress_is_plain_lines_when_the_output_is_not_a_terminal(tmp_path, capsys):
    """Before: a CI log or nohup file got tqdm's carriage-return redraws, one unreadable line per run. Now
    one line every total/20 steps and at the last, naming the step, the metrics and the time left."""
    logger = MetricsLogger(str(tmp_path), total_steps=40, progress=True, tensorboard=False)
    for step in range(0, 41):
        logger.log(step, {"reward/mean": step / 40, "update/loss": 0.5})
    logger.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train step")]
    assert [line.split()[2] for line in lines] == [f"{s}/40" for s in range(2, 41, 2)]
    assert lines[-1].startswith("train step 40/40 (100%) | reward 1 | loss 0.5 | ") and "s left" in lines[-1]
    assert "\r" not in capsys.readouterr().err


def test_progress_bar_shows_the_step_reached(tmp_path, capsys, monkeypatch):
    """Before: the bar advanced once per logged row, so the held-out evaluation logged at step 0
    made a 200-step demo end at "201it" past its total."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: the bar
    logger = MetricsLogger(str(tmp_path), total_steps=3, progress=True, tensorboard=False)
    logger.log(0, {"heldout/reward": 0.5})
    assert logger._progress.bar.n == 0
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": 0.1})
    assert logger._progress.bar.n == 3
    logger.close()
    assert "3/3" in capsys.readouterr().err
    # A resumed run's bar starts at the step it resumes from and ends at the total.
    logger = MetricsLogger(str(tmp_path), total_steps=3, start_step=2, progress=True, tensorboard=False)
    logger.log(3, {"reward/mean": 0.2})
    assert logger._progress.bar.n == 3
    logger.close()
