"""``jaxrl eval`` and ``jaxrl filter`` end to end on a tiny random model with the embedded sampler.

Task "right" always scores 1 and task "wrong" always 0, so whatever the model samples the figures
are known: avg@n and pass@k 1 and 0 per task, the overall ones the share of "right" prompts; the
filter keeps exactly the "right" rows under the band (0, 1]."""

import json

from jaxrl.cli import main
from jaxrl.demo import write_demo_files
from jaxrl.reward import RewardResult

ARCHITECTURE = {"vocab_size": 17, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                "num_kv_heads": 1, "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 32}


def right(prompt, response, response_ids, row):
    return RewardResult(score=1.0)


def wrong(prompt, response, response_ids, row):
    return RewardResult(score=0.0)


def _config(tmp_path):
    files = write_demo_files(str(tmp_path / "demo"), max_operand=5, heldout=9)
    rows = [json.loads(line) for line in open(files["heldout"])]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps({**r, "task": "right" if i % 3 else "wrong"}) + "\n"
                            for i, r in enumerate(rows)))
    config = {
        "output_dir": str(tmp_path / "out"), "seed": 1,
        "model": {"architecture": ARCHITECTURE, "init_seed": 1},
        "data": {"tokenizer": files["tokenizer"], "train_files": [str(data)], "eval_files": [str(data)],
                 "use_chat_template": False, "max_prompt_tokens": 6},
        "rollout": {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 4},
        "reward": {"default_task": None,
                   "tasks": {t: {"kind": "python", "function": f"{__name__}:{t}"} for t in ("right", "wrong")}},
        "eval": {"samples": 4, "k": [1, 4]},
        "filter": {"output": str(tmp_path / "kept.jsonl"), "samples": 3,
                   "bands": {"right": {"low": 0, "high": 1}, "wrong": {"low": 0, "high": 1}}},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path), len(rows), sum(1 for i in range(len(rows)) if i % 3)


def test_eval_and_filter_commands(tmp_path, capsys):
    config, prompts, rights = _config(tmp_path)
    out = tmp_path / "eval.json"
    assert main(["eval", config, "--json", str(out), "eval.temperature=0.7"]) == 0
    result = json.loads(out.read_text())
    assert result["tasks"]["right"] == {"prompts": rights, "n": 4, "avg@4": 1.0, "unparsable": 0.0,
                                        "pass@1": 1.0, "pass@4": 1.0}
    assert result["tasks"]["wrong"]["avg@4"] == 0.0 and result["tasks"]["wrong"]["pass@4"] == 0.0
    assert result["overall"]["avg@4"] == rights / prompts
    assert result["sampling"]["temperature"] == 0.7 and result["sampling"]["model"] == "random init"
    assert "pass@4" in capsys.readouterr().out

    assert main(["filter", config]) == 0
    kept = [json.loads(line) for line in open(tmp_path / "kept.jsonl")]
    assert len(kept) == rights and {r["task"] for r in kept} == {"right"} and {r["pass_rate"] for r in kept} == {1.0}
    assert f"kept {rights}/{prompts}" in capsys.readouterr().out
    assert main(["filter", config]) == 0  # a rerun finds every prompt scored
    assert f"{prompts} prompts already scored, 0 to go" in capsys.readouterr().out


def test_bad_config_exits_2(tmp_path, capsys):
    config, _, _ = _config(tmp_path)
    assert main(["eval", config, "eval.k=[9]"]) == 2
    assert "eval.k" in capsys.readouterr().err


def test_filter_refuses_to_write_over_its_input(tmp_path, capsys):
    """Before: ``filter.output`` equal to the input (by name, or through a link) exited 0 and the input
    held only the kept rows. Now the command stops before loading a model, naming both, and the
    input's bytes are unchanged."""
    config, _, _ = _config(tmp_path)
    data = tmp_path / "mixed.jsonl"
    before = data.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(data)
    for output in (str(data), f"{tmp_path}/sub/../mixed.jsonl", str(tmp_path / "link.jsonl")):
        (tmp_path / "sub").mkdir(exist_ok=True)
        assert main(["filter", config, f"filter.output={output}"]) == 2
        err = capsys.readouterr().err
        assert f"filter.output is {output}, which is the input file {data}" in err and len(err.splitlines()) == 1
    assert main(["filter", config, f"filter.output={tmp_path}/kept.jsonl", f"filter.summary={data}"]) == 2
    assert f"filter.summary is {data}, which is the input file" in capsys.readouterr().err
    assert main(["filter", config, f"filter.output={tmp_path}/kept.jsonl", "filter.summary=",
                 f"data.train_files=[{tmp_path}/kept.jsonl.summary.json]"]) == 2
    assert "the summary file next to filter.output is" in capsys.readouterr().err
    assert data.read_bytes() == before and not (tmp_path / "out").exists()


def test_eval_refuses_a_negative_prompt_count(tmp_path, capsys):
    """Before: ``jaxrl eval --max-prompts -3`` was accepted (and scored all but the last three prompts)."""
    config, _, _ = _config(tmp_path)
    try:
        main(["eval", config, "--max-prompts", "-3"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--max-prompts -3 was accepted")
    assert "argument --max-prompts: '-3' is not a whole number >= 0" in capsys.readouterr().err


def test_eval_self_verification(tmp_path, capsys):
    """``eval.self_verify``: the model verifies its samples and refines them once; Best@n picks one
    sample per prompt and pass@1 counts every sample, so both are 1 on "right" and 0 on "wrong"
    whatever the random model writes: the overall figures are the share of "right" prompts."""
    config, prompts, rights = _config(tmp_path)
    (tmp_path / "verify.txt").write_text("{problem}{proof}")
    (tmp_path / "refine.txt").write_text("{problem}{proof}{analysis}")
    settings = json.loads(open(config).read())
    settings["eval"]["self_verify"] = {"template": str(tmp_path / "verify.txt"), "samples": 2, "refine_rounds": 1,
                                       "refine_template": str(tmp_path / "refine.txt")}
    with open(config, "w") as f:
        json.dump(settings, f)
    out = tmp_path / "eval.json"
    assert main(["eval", config, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tasks"]["right"]["best@4"] == 1.0 and result["tasks"]["wrong"]["best@4"] == 0.0
    assert result["overall"]["best@4"] == rights / prompts
    assert 0.0 <= result["overall"]["self_verified"] <= 1.0 and "verifier_accuracy" in result["overall"]
    assert result["refinement"]["pass@1"] == [rights / prompts] * 2
    assert "best@4" in capsys.readouterr().out
    assert main(["eval", config, "eval.self_verify.samples=0"]) == 2
    assert "eval.self_verify.samples=0 must be >= 1" in capsys.readouterr().err
    assert main(["eval", config, f"eval.self_verify.refine_template={tmp_path / 'verify.txt'}"]) == 2
    assert "eval.self_verify.refine_template=" in (err := capsys.readouterr().err) and "no {analysis} slot" in err
