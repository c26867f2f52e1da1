"""Batch dumps (round trip, bad input naming the sequence), the gate, the CLI exit codes, the PNGs."""

import math
import os

import numpy as np
import pytest

from jaxrl.align import AlignmentBatch, Gate, build_report
from jaxrl.align import plots
from jaxrl.align.cli import main
from jaxrl.rollout.base import Conversation, Sample


def conversations():
    a = Conversation.from_prompt([5, 6, 7])
    a = a.add_model_turn(Sample(np.array([8, 9]), np.array([3, 4]), np.log([0.5, 0.25]).astype(np.float32),
                                "length", "v1"))
    a = a.add_environment_tokens([1, 1])
    a = a.add_model_turn(Sample(np.array([0]), np.array([2]), np.log([0.125]).astype(np.float32), "stop", "v1"))
    b = Conversation.from_prompt([4])
    b = b.add_model_turn(Sample(np.array([4]), np.array([3, 3, 3]), np.log([0.9, 0.8, 0.7]).astype(np.float32),
                                "length", "v1"))
    return [a, b]


def scored(ratio: float) -> AlignmentBatch:
    """Learner logprob = rollout logprob + log(ratio) on every model token."""
    batch = AlignmentBatch.from_conversations(conversations(), meta={"weight_version": "v1"})
    return batch.with_learner_logprobs(np.where(batch.model_mask, batch.rollout_logprobs + math.log(ratio), 0))


def test_from_conversations_layout():
    batch = AlignmentBatch.from_conversations(conversations())
    assert batch.token_ids.shape == (2, 8)
    assert batch.prompt_lengths.tolist() == [3, 1] and batch.lengths.tolist() == [8, 4]
    assert batch.model_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert batch.turn_ids[0].tolist() == [-1, -1, -1, 0, 0, -1, -1, 1]


def test_dump_round_trip(tmp_path):
    batch = scored(0.9)
    path = tmp_path / "batch.npz"
    batch.save(path)
    back = AlignmentBatch.load(path)
    for key in ("token_ids", "model_mask", "rollout_logprobs", "learner_logprobs", "turn_ids", "prompt_lengths",
                "lengths"):
        np.testing.assert_array_equal(getattr(back, key), getattr(batch, key))
    assert back.meta["weight_version"] == "v1"


def base_arrays():
    batch = scored(0.9)
    return dict(token_ids=batch.token_ids, model_mask=batch.model_mask, rollout_logprobs=batch.rollout_logprobs,
                turn_ids=batch.turn_ids, prompt_lengths=batch.prompt_lengths, lengths=batch.lengths,
                learner_logprobs=batch.learner_logprobs)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(learner_logprobs=a["learner_logprobs"][:, :-1]),
     "7 positions per sequence but token_ids has 8"),
    (lambda a: a["rollout_logprobs"].__setitem__((1, 2), 0.3), r"sequence 1, position 2: rollout_logprobs is 0.3 > 0"),
    (lambda a: a["learner_logprobs"].__setitem__((0, 4), np.nan), r"sequence 0, position 4: learner_logprobs is nan"),
    (lambda a: a["model_mask"].__setitem__((1, 0), True), r"sequence 1: model_mask marks prompt position 0"),
    (lambda a: a["model_mask"].__setitem__((1, 6), True), r"sequence 1: model_mask marks padding position 6"),
])
def test_bad_input_names_sequence_and_problem(change, message):
    arrays = {k: np.array(v) for k, v in base_arrays().items()}
    change(arrays)
    with pytest.raises(ValueError, match=message):
        AlignmentBatch(**arrays)


def test_conversation_with_ragged_fields_is_rejected():
    convs = conversations()
    convs[1].rollout_logprobs = convs[1].rollout_logprobs[:-1]
    with pytest.raises(ValueError, match="sequence 1: conversation fields have different lengths"):
        AlignmentBatch.from_conversations(convs)


def test_per_sequence_learner_logprobs_of_another_length_name_the_sequence():
    batch = AlignmentBatch.from_conversations(conversations())
    rows = [np.zeros(8, np.float32), np.zeros(5, np.float32)]
    with pytest.raises(ValueError, match="sequence 1: the learner scored 5 tokens but the rollout sequence has 4"):
        batch.with_learner_logprobs(rows)
    scored = batch.with_learner_logprobs([np.full(8, -1.0), np.full(4, -2.0)])
    assert scored.learner_logprobs[1, 1] == -2.0 and scored.learner_logprobs[1, 0] == 0.0  # prompt stays 0


def test_load_names_file_and_missing_arrays(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, token_ids=np.zeros((1, 2), np.int32))
    with pytest.raises(ValueError, match="bad.npz.*lacks arrays"):
        AlignmentBatch.load(path)


def test_gate_passes_below_and_fails_above():
    report = build_report(scored(0.9))  # k3 = 0.9 - 1 - log 0.9 = 0.005360...
    k3 = 0.9 - 1 - math.log(0.9)
    assert report["overall"]["k3"] == pytest.approx(k3, rel=1e-4)
    assert Gate({"k3": 0.006}).check(report).passed
    failed = Gate({"k3": 0.005, "abs_log_ratio_max": 1.0}).check(report)
    assert not failed.passed and len(failed.failures) == 1 and "k3" in failed.failures[0]
    with pytest.raises(ValueError, match="unknown metric 'kk3'"):
        Gate({"kk3": 1.0})


def test_cli_exit_codes_and_files(tmp_path):
    dump = tmp_path / "batch.npz"
    scored(0.9).save(dump)
    out = tmp_path / "out"
    assert main(["report", str(dump), "--out", str(out), "--max-k3", "0.006"]) == 0
    assert main(["report", str(dump), "--out", str(out), "--max-k3", "0.005", "--no-figures"]) == 1
    assert main(["report", str(dump), "--out", str(out), "--limit", "abs_log_ratio_max=0.2"]) == 0
    assert main(["report", str(dump), "--out", str(out), "--limit", "abs_log_ratio_max=0.1"]) == 1
    assert main(["report", str(tmp_path / "missing.npz"), "--out", str(out)]) == 2
    assert (out / "report.json").stat().st_size > 0 and "k3" in (out / "summary.txt").read_text()


def test_pngs_written_and_non_empty(tmp_path):
    paths = plots.write_all(scored(0.9), str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == sorted(plots.FIGURES)
    for p in paths:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 5000, p
