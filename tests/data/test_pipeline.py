"""Data pipeline: formats, bad rows, sharding, shuffling, resumable iteration, chat template."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl.data import (
    AllRowsBadError, BatchIterator, DataConfig, encode_prompt, load_examples, load_tokenizer, make_char_tokenizer,
    stop_token_ids,
)
from jaxrl.errors import InputError

ALPHABET = "0123456789+-*= abcdefghijklmnopqrstuvwxyz:\n<>/"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_char_tokenizer(str(folder), ALPHABET, words=[r"\boxed{", "}"])
    return load_tokenizer(str(folder))


def _jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return str(path)


def test_char_tokenizer_round_trip(tokenizer):
    ids = tokenizer.encode(r"12+7=\boxed{19}", add_special_tokens=False)
    # 5 characters, one word token, 2 characters, the closing-brace word: 9 ids.
    assert len(ids) == 9
    assert tokenizer.decode(ids) == r"12+7=\boxed{19}"
    assert tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0


def test_stop_ids_are_the_tokenizers_eos_and_the_models_own(tokenizer, tmp_path):
    """The tokenizer's eos (1), then each eos_token_id of the model folder's config.json and
    generation_config.json (one id or a list), once each; no folder, or files without one: eos only."""
    assert stop_token_ids(tokenizer) == (1,) and stop_token_ids(tokenizer, str(tmp_path)) == (1,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9, 7]}))
    assert stop_token_ids(tokenizer, str(tmp_path)) == (1, 7, 9)


def test_jsonl_and_parquet_give_same_examples(tokenizer, tmp_path):
    rows = [{"q": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    jsonl = _jsonl(tmp_path / "a.jsonl", rows)
    parquet = str(tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    config = DataConfig(prompt_field="q")
    a, _ = load_examples([jsonl], config, tokenizer)
    b, _ = load_examples([parquet], config, tokenizer)
    assert [e.prompt for e in a] == [e.prompt for e in b] == [r["q"] for r in rows]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.prompt_ids, y.prompt_ids)
        assert x.row == y.row
    np.testing.assert_array_equal(a[0].prompt_ids, tokenizer.encode("0+1=", add_special_tokens=False))


def test_bad_rows_are_skipped_named_and_counted(tokenizer, tmp_path, caplog):
    path = _jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "1+1="},            # line 1 good
        {"question": "1+2="},          # line 2 missing field
        {"prompt": "   "},             # line 3 empty prompt
        {"prompt": "1" * 50},          # line 4 too long
        "{not json",                   # line 5 unreadable
        {"prompt": "2+2="},            # line 6 good
    ])
    with caplog.at_level(logging.WARNING):
        examples, report = load_examples([path], DataConfig(max_prompt_tokens=20), tokenizer)
    assert [e.prompt for e in examples] == ["1+1=", "2+2="]
    assert [e.where for e in examples] == [f"{path} line 1", f"{path} line 6"]
    assert report.total_rows == 6 and report.bad_rows == 4
    assert report.bad_by_reason == {"missing_field": 1, "empty_prompt": 1, "too_long": 1, "unreadable": 1}
    assert report.first_bad == {"missing_field": [f"{path} line 2"], "empty_prompt": [f"{path} line 3"],
                                "too_long": [f"{path} line 4"], "unreadable": [f"{path} line 5"]}
    # One warning per problem, naming the file, the problem and the (1-based) line.
    for line, problem in ((2, "missing field 'prompt'"), (3, "empty or non-text field 'prompt'"),
                          (4, "prompt longer than data.max_prompt_tokens=20"), (5, "not valid JSON")):
        assert f"skipped 1 row of {path}: {problem} (line {line}" in caplog.text
    assert len(caplog.records) == 4
    assert not any(f"(line {good}" in r.getMessage() for r in caplog.records for good in (1, 6))


def test_all_bad_rows_is_an_error(tokenizer, tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [{"x": 1}, {"prompt": ""}])
    with pytest.raises(AllRowsBadError, match="all 2 rows"):
        load_examples([path], DataConfig(), tokenizer)


def test_missing_file_and_unknown_format(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_examples([str(tmp_path / "nope.jsonl")], DataConfig(), tokenizer)
    (tmp_path / "x.csv").write_text("prompt\n1\n")
    with pytest.raises(ValueError, match="unknown format"):
        load_examples([str(tmp_path / "x.csv")], DataConfig(), tokenizer)


def test_sft_rows_need_a_response(tokenizer, tmp_path):
    path = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "response": "2"}, {"prompt": "1+2="}])
    examples, report = load_examples([path], DataConfig(), tokenizer, with_response=True)
    assert report.bad_by_reason == {"missing_field": 1}
    np.testing.assert_array_equal(examples[0].response_ids, tokenizer.encode("2", add_special_tokens=False) + [1])
    np.testing.assert_array_equal(examples[0].response_mask, [1, 1])


def test_sft_conversation_rows_train_on_the_model_turns_only(tokenizer, tmp_path):
    turns = [{"role": "model", "text": "2*3"}, {"role": "environment", "text": "\n<6>\n"},
             {"role": "model", "text": r"\boxed{6}"}]
    bad = [[{"role": "environment", "text": "6"}], [{"role": "user", "text": "6"}], [{"role": "model", "text": ""}],
           ["2*3"], []]
    path = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "2*3=", "response": turns},
                                           *({"prompt": "2*3=", "response": b} for b in bad)])
    (example,), report = load_examples([path], DataConfig(), tokenizer, with_response=True)
    assert report.bad_by_reason == {"empty_response": 2, "bad_turns": 3}
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    # Each model turn ends with eos, as the engine's turns do; the environment's text is not trained on.
    np.testing.assert_array_equal(example.response_ids,
                                  encode("2*3") + [1] + encode("\n<6>\n") + encode(r"\boxed{6}") + [1])
    np.testing.assert_array_equal(example.response_mask, [1] * 4 + [0] * 5 + [1] * 4)


def _examples(tokenizer, tmp_path, n):
    path = _jsonl(tmp_path / "n.jsonl", [{"prompt": f"{i}="} for i in range(n)])
    return load_examples([path], DataConfig(), tokenizer)[0]


def _ids(batch):
    return [e.prompt for e in batch]


def test_shuffle_is_seeded_and_covers_each_epoch(tokenizer, tmp_path):
    examples = _examples(tokenizer, tmp_path, 12)
    first = [_ids(next(BatchIterator(examples, 4, seed=3))) for _ in range(2)]
    assert first[0] == first[1]
    it = BatchIterator(examples, 4, seed=3)
    epoch1 = sum((_ids(next(it)) for _ in range(3)), [])
    epoch2 = sum((_ids(next(it)) for _ in range(3)), [])
    assert sorted(epoch1) == sorted(epoch2) == sorted(e.prompt for e in examples)
    assert epoch1 != [e.prompt for e in examples]  # Shuffled.
    assert epoch1 != epoch2  # Reshuffled each epoch.
    assert _ids(next(BatchIterator(examples, 4, seed=4))) != first[0]


def test_processes_get_disjoint_shards(tokenizer, tmp_path):
    examples = _examples(tokenizer, tmp_path, 12)
    seen = [sum((_ids(next(it)) for _ in range(2)), []) for it in
            (BatchIterator(examples, 3, seed=0, process_index=p, process_count=2) for p in range(2))]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(e.prompt for e in examples)
    with pytest.raises(ValueError, match=r"a batch of 7 prompts \(rollout.prompts_per_step; sft.batch_size in SFT\) "
                                         r"exceeds the 6 valid rows of process 1"):
        BatchIterator(examples, 7, process_index=1, process_count=2)


def test_iterator_state_resumes_exactly(tokenizer, tmp_path):
    examples = _examples(tokenizer, tmp_path, 10)
    straight = BatchIterator(examples, 3, seed=1)
    expected = [_ids(next(straight)) for _ in range(7)]
    first = BatchIterator(examples, 3, seed=1)
    got = [_ids(next(first)) for _ in range(4)]
    state = json.loads(json.dumps(first.state()))  # The state survives a JSON round trip (checkpoints).
    resumed = BatchIterator(examples, 3, seed=1)
    resumed.restore(state)
    got += [_ids(next(resumed)) for _ in range(3)]
    assert got == expected


def test_chat_template_is_applied_when_present(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    folder = str(tmp_path / "chat")
    make_char_tokenizer(folder, ALPHABET, chat_template=template)
    tok = load_tokenizer(folder)
    ids = encode_prompt(tok, "1+1=")
    assert tok.decode(ids) == "<user>1+1=\n<assistant>"
    assert tok.decode(encode_prompt(tok, "1+1=", use_chat_template=False)) == "1+1="
    assert (tok.decode(encode_prompt(tok, "1+1=", system_prompt="be brief"))
            == "<system>be brief\n<user>1+1=\n<assistant>")


_LOADED_IN_A_FRESH_PROCESS = """
import json, sys
from jaxrl.data import encode_prompt, load_tokenizer
for folder in sys.argv[2:]:
    tok = load_tokenizer(folder)
    print(json.dumps({"torch imported": "torch" in sys.modules, "class": type(tok).__name__,
                      "ids": encode_prompt(tok, sys.argv[1]), "specials": tok.all_special_tokens,
                      "pad, eos": [tok.pad_token_id, tok.eos_token_id], "size": len(tok)}))
"""


def test_a_tokenizer_loads_as_auto_tokenizer_loads_it(tmp_path):
    """load_tokenizer gives what ``AutoTokenizer`` gives: the same class, ids through the chat template,
    special tokens, pad and eos. A folder with no model config.json whose tokenizer_config.json names the
    generic fast tokenizer (TokenizersBackend; PreTrainedTokenizerFast from transformers 4) skips
    ``AutoTokenizer``'s import of torch, a CLI's start on a tokenizer-only folder; a model folder and a
    model-specific class go through ``AutoTokenizer``. One fresh process loads the folders in this order."""
    from transformers import AutoTokenizer

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    cases = [("TokenizersBackend", False), ("PreTrainedTokenizerFast", False), ("TokenizersBackend", True),
             ("Qwen2Tokenizer", False)]
    folders = []
    for i, (tokenizer_class, model_config) in enumerate(cases):
        folder = tmp_path / f"tok{i}"
        make_char_tokenizer(str(folder), ALPHABET, words=[r"\boxed{", "}"], chat_template=template)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
        if model_config:
            (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
        folders.append(str(folder))
    text = r"12+7=\boxed{19}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _LOADED_IN_A_FRESH_PROCESS, text, *folders], capture_output=True,
                         text=True, env=env, check=True)
    loaded = [json.loads(line) for line in out.stdout.splitlines()[-len(cases):]]
    assert [ours.pop("torch imported") for ours in loaded] == [False, False, True, True]
    for ours, folder in zip(loaded, folders, strict=True):
        theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        assert ours == {"class": type(theirs).__name__, "ids": encode_prompt(theirs, text),
                        "specials": theirs.all_special_tokens,
                        "pad, eos": [theirs.pad_token_id, theirs.eos_token_id], "size": len(theirs)}, folder
    assert [ours["class"] for ours in loaded] == ["TokenizersBackend"] * 3 + ["Qwen2Tokenizer"]


def _mixed_examples(tokenizer, tmp_path, counts):
    rows = [{"prompt": f"{task}{i}=", "task": task} for task, n in counts.items() for i in range(n)]
    return load_examples([_jsonl(tmp_path / "mix.jsonl", rows)], DataConfig(), tokenizer)[0]


def test_mixture_batches_carry_the_configured_shares_and_resume(tokenizer, tmp_path):
    """Weights 0.5 / 0.3 / 0.2 over groups of 12, 4 and 30 rows (so shares are not the rows'):
    over 40 batches of 10 each group's share lies within 3 standard errors of its weight, the
    small group repeats, and a restored iterator continues exactly."""
    examples = _mixed_examples(tokenizer, tmp_path, {"a": 12, "b": 4, "c": 30})
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    it = BatchIterator(examples, 10, seed=0, mixture=weights)
    seen = [e.row["task"] for _ in range(40) for e in next(it)]
    for task, weight in weights.items():
        share = seen.count(task) / len(seen)
        assert abs(share - weight) <= 3 * np.sqrt(weight * (1 - weight) / len(seen)), (task, share)
    state = it.state()
    following = _ids(next(it))
    resumed = BatchIterator(examples, 10, seed=0, mixture=weights)
    resumed.restore(state)
    assert _ids(next(resumed)) == following


def test_mixture_errors_name_the_row_or_the_weight(tokenizer, tmp_path):
    examples = _mixed_examples(tokenizer, tmp_path, {"a": 4, "b": 4})
    with pytest.raises(InputError, match=r"task 'b' has no weight in data.mixture \['a'\]"):
        BatchIterator(examples, 2, mixture={"a": 1.0})
    with pytest.raises(InputError, match=r"data.mixture names \['z'\] but no valid row"):
        BatchIterator(examples, 2, mixture={"a": 1.0, "b": 1.0, "z": 1.0})
    with pytest.raises(ValueError, match=r"data.mixture.a must be a weight >= 0"):
        DataConfig(mixture={"a": -1.0})
    with pytest.raises(ValueError, match=r"data.mixture gives every group weight 0"):
        DataConfig(mixture={"a": 0.0})
    only_a = BatchIterator(examples, 2, mixture={"a": 1.0, "b": 0.0})
    assert {e.row["task"] for _ in range(4) for e in next(only_a)} == {"a"}
