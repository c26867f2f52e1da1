"""Bad inputs: each is named (file, line/row, path), costs only itself, and stops a command with status 2.

One test per defect; each docstring starts with the failure it fixes. Tiny models and
files only: no training, no server.
"""

import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx

from jaxrl.align import AlignmentBatch
from jaxrl.align.cli import main as align_main
from jaxrl.data import AllRowsBadError, DataConfig, load_examples, load_tokenizer, make_char_tokenizer, read_rows
from jaxrl.errors import InputError
from jaxrl.models import Decoder, ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from jaxrl.rollout.base import Conversation, Sample

ALPHABET = "0123456789+-*= abcdefghijklmnopqrstuvwxyz:\n<>/"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_char_tokenizer(str(folder), ALPHABET)
    return load_tokenizer(str(folder))


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            f.write(b"\n")
    return str(path)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "jaxrl.data.pipeline"]


# ---- data rows -----------------------------------------------------------------------------------------------


def test_non_utf8_byte_skips_only_its_row(tokenizer, tmp_path, caplog):
    """Before: a single non-UTF-8 byte in train.jsonl raised UnicodeDecodeError and stopped the run
    (the file was read as text in one go). Now that line alone is a bad row, named by file and
    1-based line and the byte, and every other row loads."""
    path = write_lines(tmp_path / "train.jsonl", [
        {"prompt": "1+1="}, b'{"prompt": "2+2=\xff"}', {"prompt": "3+3="}, {"prompt": "4+4="}])
    rows = list(read_rows(path))
    assert [r.index for r in rows] == [1, 2, 3, 4]
    assert rows[1].data is None and rows[1].where == f"{path} line 2"
    assert rows[1].problem == "not valid UTF-8: at byte 16 of the line (0xff, file offset 35)"
    with caplog.at_level(logging.WARNING):
        examples, report = load_examples([path], DataConfig(), tokenizer)
    assert [e.prompt for e in examples] == ["1+1=", "3+3=", "4+4="]
    assert [e.where for e in examples] == [f"{path} line {n}" for n in (1, 3, 4)]
    assert report.bad_by_reason == {"unreadable": 1} and report.first_bad == {"unreadable": [f"{path} line 2"]}
    assert warnings_of(caplog) == [
        f"skipped 1 row of {path}: not valid UTF-8 (line 2: at byte 16 of the line (0xff, file offset 35))"]


def test_row_check_skips_and_counts_with_one_warning_per_problem(tokenizer, tmp_path, caplog):
    """Before: load_examples could not skip rows the reward router cannot grade (a task with no
    reward function, no answer field): they reached RewardRouter.score, which raises ValueError
    mid-run; and every bad row got its own warning, so a file with thousands buried the log.
    Now ``row_check`` skips and counts them at load, one warning per (problem, file) with its
    count and first lines."""
    rows = []
    for i in range(12):
        if i % 3 == 1:
            rows.append({"prompt": f"{i}+1=", "task": "nope", "answer": "1"})  # lines 2, 5, 8, 11
        elif i % 3 == 2:
            rows.append({"prompt": f"{i}+1=", "task": "math"})  # lines 3, 6, 9, 12
        else:
            rows.append({"prompt": f"{i}+1=", "task": "math", "answer": str(i + 1)})
    rows += [{"prompt": "0+0=", "task": "math"}] * 3  # lines 13-15: more of a problem than the first lines shown
    path = write_lines(tmp_path / "data.jsonl", rows)

    def row_check(row):
        if row["task"] != "math":
            return "unknown_task", f"task {row['task']!r} has no reward function (reward.tasks: ['math'])"
        if "answer" not in row:
            return "missing_answer", "missing field 'answer' (the math reward needs it)"
        return None

    with caplog.at_level(logging.WARNING):
        examples, report = load_examples([path], DataConfig(), tokenizer, row_check=row_check)
    assert [e.prompt for e in examples] == ["0+1=", "3+1=", "6+1=", "9+1="]
    assert report.total_rows == 15 and report.bad_rows == 11
    assert report.bad_by_reason == {"unknown_task": 4, "missing_answer": 7}
    assert report.first_bad["missing_answer"] == [f"{path} line {n}" for n in (3, 6, 9, 12, 13)]
    assert sorted(warnings_of(caplog)) == sorted([
        f"skipped 4 rows of {path}: task 'nope' has no reward function (reward.tasks: ['math']) (lines 2, 5, 8, 11)",
        f"skipped 7 rows of {path}: missing field 'answer' (the math reward needs it) (lines 3, 6, 9, 12, 13, ...)",
    ])


def test_reward_router_row_problem_plugs_in(tokenizer, tmp_path, caplog):
    """Before: the reward router's ``row_problem`` had no place in loading (see above). With the
    real router: unknown tasks and missing answers are skipped, counted by reason, one warning
    per reason naming the file and lines."""
    from jaxrl.reward.base import RewardRouter

    router = RewardRouter({"math": lambda *args: None}, default_task="math", answer_fields={"math": "answer"})
    path = write_lines(tmp_path / "mixed.jsonl", [
        {"prompt": "1=", "answer": "1"}, {"prompt": "2=", "task": "code", "answer": "x"}, {"prompt": "3="},
        {"prompt": "4=", "task": "code"}, {"prompt": "5=", "answer": "5"}])
    with caplog.at_level(logging.WARNING):
        examples, report = load_examples([path], DataConfig(), tokenizer, row_check=router.row_problem)
    assert [e.where for e in examples] == [f"{path} line 1", f"{path} line 5"]
    assert report.bad_by_reason == {"unknown_task": 2, "missing_answer": 1}
    messages = warnings_of(caplog)
    assert len(messages) == 2
    assert messages[0].startswith(f"skipped 2 rows of {path}: ") and "'code'" in messages[0]
    assert messages[0].endswith("(lines 2, 4)")
    assert messages[1].startswith(f"skipped 1 row of {path}: ") and "'answer'" in messages[1]
    assert messages[1].endswith("(line 3)")


def test_every_row_bad_names_files_and_reasons(tokenizer, tmp_path):
    """Before: a dataset whose rows were all bad raised a plain ValueError (a traceback from
    `jaxrl train`) listing reasons without where to look. Now AllRowsBadError is an InputError
    naming the file, the counts per reason and the first bad line of each."""
    path = write_lines(tmp_path / "bad.jsonl", [{"question": "1"}, {"question": "2"}, b"\xfe"])
    with pytest.raises(AllRowsBadError) as info:
        load_examples([path], DataConfig(), tokenizer)
    assert isinstance(info.value, InputError)
    message = str(info.value)
    assert f"all 3 rows of {path} are bad (2 missing_field, 1 unreadable" in message
    assert f"missing_field: {path} line 1" in message and f"unreadable: {path} line 3" in message


def test_truncated_parquet_is_named(tokenizer, tmp_path):
    """Before: a truncated Parquet file raised pyarrow's ArrowInvalid ("Parquet magic bytes not
    found") without saying which of the data files it was. Now an InputError names the file;
    good Parquet rows are numbered "FILE row N" from 1."""
    good = str(tmp_path / "good.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{i}="} for i in range(4)]), good)
    assert [r.where for r in read_rows(good)] == [f"{good} row {n}" for n in (1, 2, 3, 4)]
    data = open(good, "rb").read()
    cut = str(tmp_path / "cut.parquet")
    with open(cut, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(InputError, match=f"data file '{cut}' is not a readable Parquet file"):
        load_examples([good, cut], DataConfig(), tokenizer)


def test_missing_file_and_unknown_format_are_input_errors(tokenizer, tmp_path):
    """Before: a missing data file raised a bare FileNotFoundError and an unknown suffix a bare
    ValueError, which `jaxrl train` showed as a traceback. Now both are InputErrors (the missing
    one also a FileNotFoundError) naming the file."""
    with pytest.raises(InputError, match="nope.jsonl.*does not exist") as info:
        load_examples([str(tmp_path / "nope.jsonl")], DataConfig(), tokenizer)
    assert isinstance(info.value, FileNotFoundError)
    (tmp_path / "x.csv").write_text("prompt\n1\n")
    with pytest.raises(InputError, match="x.csv.*unknown format"):
        load_examples([str(tmp_path / "x.csv")], DataConfig(), tokenizer)


# ---- tokenizer and model folders -----------------------------------------------------------------------------


def test_empty_tokenizer_folder_is_named(tmp_path):
    """Before: an empty tokenizer folder passed the existence check, then transformers raised
    "Couldn't instantiate the backend tokenizer ... sentencepiece or tiktoken" with a traceback
    that named neither the folder nor what belongs in it."""
    folder = tmp_path / "tok"
    folder.mkdir()
    with pytest.raises(InputError, match=f"tokenizer folder '{folder}' has no tokenizer files.*it is empty.*"
                                         "tokenizer.json"):
        load_tokenizer(str(folder))


def test_broken_tokenizer_json_is_named(tmp_path):
    """Before: a truncated tokenizer.json raised json's "Unterminated string starting at: line 1
    column 20" from inside transformers, and one missing keys a bare KeyError('added_tokens'),
    neither naming the file."""
    folder = tmp_path / "tok"
    make_char_tokenizer(str(folder), ALPHABET)
    tokenizer_json = folder / "tokenizer.json"
    text = tokenizer_json.read_text()
    tokenizer_json.write_text(text[: len(text) // 2])
    with pytest.raises(InputError, match=f"{tokenizer_json} is not valid JSON"):
        load_tokenizer(str(folder))
    tokenizer_json.write_text('{"version": "1.0"}')
    with pytest.raises(InputError, match=f"tokenizer folder '{folder}' cannot be loaded by transformers "
                                         r"\(KeyError: missing key 'added_tokens'\)"):
        load_tokenizer(str(folder))


def tiny_model(folder):
    config = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=4)
    save_hf_checkpoint(Decoder(config, rngs=nnx.Rngs(0)), str(folder))
    return folder


def test_missing_model_folder_is_named(tmp_path):
    """Before: a missing model folder said only "<folder>/config.json not found", a
    FileNotFoundError shown as a traceback by `jaxrl train`. Now an InputError (also a
    FileNotFoundError) says the folder itself does not exist and what one holds."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(InputError, match=f"model folder '{missing}' does not exist; expected a transformers "
                                         r"checkpoint folder \(config.json \+ \*.safetensors\)") as info:
        load_hf_checkpoint(str(missing))
    assert isinstance(info.value, FileNotFoundError)


def test_truncated_safetensors_is_named(tmp_path):
    """Before: a truncated model.safetensors (an interrupted copy) raised safetensors'
    SafetensorError "Error while deserializing header: incomplete metadata, file not fully
    covered", which names no file and is not even an OSError or ValueError."""
    folder = tiny_model(tmp_path / "model")
    load_hf_checkpoint(str(folder))  # the intact checkpoint loads
    weights = folder / "model.safetensors"
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(InputError, match=f"{weights} is not a readable safetensors file .*truncated or corrupt"):
        load_hf_checkpoint(str(folder))


def test_invalid_config_json_is_named(tmp_path):
    """Before: a config.json cut short raised json.JSONDecodeError ("Expecting value: line 9 ...")
    and one lacking a field a bare KeyError('vocab_size'), neither naming the file."""
    folder = tiny_model(tmp_path / "model")
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config)[:40])
    with pytest.raises(InputError, match=f"{config_file} is not valid JSON"):
        load_hf_checkpoint(str(folder))
    del config["vocab_size"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(InputError, match=f"{config_file} lacks the field 'vocab_size'"):
        load_hf_checkpoint(str(folder))


# ---- jaxrl align -----------------------------------------------------------------------------------------------


def batch():
    a = Conversation.from_prompt([5, 6, 7])
    a = a.add_model_turn(Sample(np.array([8, 9]), np.array([3, 4]), np.log([0.5, 0.25]).astype(np.float32),
                                "length", "v1"))
    batch = AlignmentBatch.from_conversations([a], meta={"weight_version": "v1"})
    return batch.with_learner_logprobs(batch.rollout_logprobs)


def run_align(argv, capsys):
    code = align_main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_align_report_truncated_dump_exits_2_naming_it(tmp_path, capsys):
    """Before: `jaxrl align report` on a truncated dump raised zipfile.BadZipFile, which the CLI
    did not catch: a traceback and exit status 1, the gate's failure code."""
    dump = tmp_path / "batch.npz"
    batch().save(dump)
    data = dump.read_bytes()
    dump.write_bytes(data[: len(data) - 40])
    code, err = run_align(["report", str(dump), "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert err.count("\n") == 0 and f"batch dump '{dump}' is truncated or corrupt" in err


def test_align_report_non_npz_exits_2_naming_it(tmp_path, capsys):
    """Before: a dump that was not an .npz at all said numpy's misleading "This file contains
    pickled (object) data ... allow_pickle=" (a text file), or raised TypeError "'numpy.ndarray'
    object does not support the context manager protocol" with exit status 1 (a lone .npy)."""
    text = tmp_path / "notes.npz"
    text.write_text("hello\n")
    code, err = run_align(["report", str(text), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err == f"jaxrl align: batch dump '{text}' is not an .npz file (not a zip archive); " \
        "write dumps with jaxrl.align.AlignmentBatch.save (or the trainer's logging.dump_batch_every)"
    npy = tmp_path / "array.npy"
    np.save(npy, np.zeros(3))
    code, err = run_align(["report", str(npy), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and f"batch dump '{npy}' is not an .npz file (a single .npy array)" in err


@pytest.mark.parametrize("change, problem", [
    (lambda a: a.pop("lengths"), r"lacks arrays \['lengths'\]"),
    (lambda a: a.update(token_ids=a["token_ids"].astype(np.float32)), "token_ids has dtype float32; expected integer"),
    (lambda a: a.update(rollout_logprobs=a["rollout_logprobs"][:, :-1]), "rollout_logprobs has 4 positions"),
    (lambda a: a.update(lengths=a["lengths"][:, None]), r"lengths must have shape \(1,\)"),
    (lambda a: a.update(meta_json=np.array("{not json")), "meta_json is Expecting property name"),
    (lambda a: a.update(extra=np.zeros(2)), r"unexpected arrays \['extra'\]"),
], ids=["missing-array", "dtype", "shape", "lengths-shape", "meta", "extra-array"])
def test_align_report_wrong_format_npz_exits_2_naming_it(tmp_path, capsys, change, problem):
    """Before: an .npz with wrong arrays slipped through or failed without naming the file: float
    token ids were silently truncated to int32 (a report, exit 0), an extra array raised TypeError
    "unexpected keyword argument 'extra'" (traceback, exit 1), a bad meta_json printed only
    "Expecting property name enclosed in double quotes" (no file)."""
    dump = tmp_path / "bad.npz"
    batch().save(dump)
    with np.load(dump) as data:
        arrays = {k: data[k] for k in data.files}
    change(arrays)
    np.savez(dump, **arrays)
    code, err = run_align(["report", str(dump), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith(f"jaxrl align: batch dump '{dump}'"), err
    assert __import__("re").search(problem, err), err


@pytest.mark.parametrize("command", ["report", "run", "localize"])
def test_align_out_that_is_a_file_exits_2(tmp_path, capsys, command):
    """Before: `--out` naming an existing file raised FileExistsError from os.makedirs after all
    the work (for `run`, after sampling and scoring), a traceback with exit status 1, the gate's
    failure code. Now every subcommand checks --out first."""
    out = tmp_path / "out.txt"
    out.write_text("not a folder")
    dump = tmp_path / "batch.npz"
    batch().save(dump)
    if command == "report":
        argv = ["report", str(dump), "--out", str(out)]
    else:
        argv = [command, "--model", str(tmp_path / "model"), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]
    code, err = run_align(argv, capsys)
    assert code == 2
    assert err == f"jaxrl align: --out '{out}' is an existing file, not a folder; give a folder (made if missing)"
    assert out.read_text() == "not a folder"


def test_align_prompts_with_bad_bytes_exit_2_naming_the_line(tmp_path, capsys):
    """Before: a non-UTF-8 byte in `--prompts` printed only "'utf-8' codec can't decode byte 0xff
    in position 14: invalid start byte": no file, no line, and a position in a read buffer."""
    prompts = write_lines(tmp_path / "p.jsonl", [[1, 2, 3], b"[1, 2]\xff"])
    code, err = run_align(["run", "--model", str(tmp_path / "m"), "--prompts", prompts,
                           "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and err == f"jaxrl align: {prompts} line 2: not valid UTF-8 at byte 6 of the line"
