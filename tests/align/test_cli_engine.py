"""`jaxrl align run` / `localize` end to end on a tiny checkpoint written to disk."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.align.cli import main
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf import save_hf_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    model = Decoder(config, rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, nnx.state(model)))
    save_hf_checkpoint(model, str(folder / "model"))
    prompts = folder / "prompts.jsonl"
    rows = [[1, 2, 3, 4, 5], {"prompt_ids": [6, 7, 8, 9, 10, 11]}, [12, 13, 14, 15, 16], [17, 18, 19, 20, 21]]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(folder / "model"), str(prompts)


def test_run_raw_passes_and_processed_bias_fails_the_gate(checkpoint, tmp_path):
    model, prompts = checkpoint
    common = ["run", "--model", model, "--prompts", prompts, "--n", "2", "--max-new-tokens", "8",
              "--max-batch", "8", "--max-cache-len", "64", "--temperature", "0.7", "--top-k", "8", "--max-k3", "1e-6"]
    dump = tmp_path / "batch.npz"
    assert main(common + ["--out", str(tmp_path / "raw"), "--save-dump", str(dump), "--no-figures"]) == 0
    report = json.loads((tmp_path / "raw" / "report.json").read_text())
    assert report["overall"]["num_tokens"] == 64 and report["gate"]["passed"]
    assert report["meta"]["logprob_kind"] == "raw"
    # PROCESSED logprobs (T=0.7, top-k 8) are of another distribution than the learner's raw
    # recompute: the checker must see the bias (docs/rollouts.md#logprob-kinds, the TRL top-p issue).
    assert main(common + ["--out", str(tmp_path / "proc"), "--logprob-kind", "processed", "--no-figures"]) == 1
    assert main(["report", str(dump), "--out", str(tmp_path / "again"), "--no-figures", "--max-k3", "1e-6"]) == 0


def test_localize_decode_path_and_bad_prompts(checkpoint, tmp_path, capsys):
    model, prompts = checkpoint
    out = tmp_path / "loc"
    assert main(["localize", "--model", model, "--prompts", prompts, "--out", str(out), "--path", "decode"]) == 0
    result = json.loads((out / "localization.json").read_text())
    assert result["first_divergence"] is None and (out / "localization.png").stat().st_size > 5000
    bad = tmp_path / "bad.jsonl"
    bad.write_text('[1, 2]\n[3, "x"]\n')
    capsys.readouterr()
    assert main(["localize", "--model", model, "--prompts", str(bad), "--out", str(out)]) == 2
    # The error names the file's line and quotes what it holds there.
    err = capsys.readouterr().err
    assert "bad.jsonl line 2" in err and "got '[3, \"x\"]'" in err, err
    bad.write_text('[1, 2]\n"oops"\n')
    assert main(["localize", "--model", model, "--prompts", str(bad), "--out", str(out)]) == 2
    assert "bad.jsonl line 2: a text prompt needs --tokenizer DIR to encode it" in capsys.readouterr().err


def test_text_prompts_with_a_tokenizer_sample_what_their_token_ids_do(checkpoint, tmp_path):
    """``--tokenizer``: text prompts (a string, or {"prompt": ...}) are encoded as the trainer encodes
    them, and the tokenizer's eos joins the stop ids: the same run as with the ids and --stop-id."""
    from jaxrl.data import make_char_tokenizer

    model, _ = checkpoint
    tokenizer = make_char_tokenizer(str(tmp_path / "tokenizer"), alphabet="abcdefghij +=")
    texts = ["abc+de=", {"prompt": "j i h"}]
    text_file, ids_file = tmp_path / "text.jsonl", tmp_path / "ids.jsonl"
    text_file.write_text("\n".join(json.dumps(t) for t in texts) + "\n")
    ids = [tokenizer.encode(t if isinstance(t, str) else t["prompt"], add_special_tokens=False) for t in texts]
    ids_file.write_text("\n".join(json.dumps(i) for i in ids) + "\n")
    common = ["run", "--model", model, "--n", "2", "--max-new-tokens", "6", "--max-batch", "4",
              "--max-cache-len", "32", "--no-figures", "--seed", "3"]
    assert main([*common, "--prompts", str(text_file), "--tokenizer", str(tmp_path / "tokenizer"),
                 "--out", str(tmp_path / "text"), "--save-dump", str(tmp_path / "text.npz")]) == 0
    assert main([*common, "--prompts", str(ids_file), "--stop-id", str(tokenizer.eos_token_id),
                 "--out", str(tmp_path / "ids"), "--save-dump", str(tmp_path / "ids.npz")]) == 0
    text_run, ids_run = np.load(tmp_path / "text.npz"), np.load(tmp_path / "ids.npz")
    np.testing.assert_array_equal(text_run["token_ids"], ids_run["token_ids"])
    meta = json.loads((tmp_path / "text" / "report.json").read_text())["meta"]
    assert meta["sampling"]["stop_token_ids"] == [tokenizer.eos_token_id]
