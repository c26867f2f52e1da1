"""`jaxrl align run --engine sglang` end to end against a real CPU SGLang server.

The server is the session fixture ``sglang_dense`` (tests/conftest.py), shared with
tests/rollout/test_sglang.py; the CLI loads the same HF folder into the JAX learner.
"""

import json
import socket

import pytest

from jaxrl.align.cli import main
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON

ALIGN_TOL = 1e-5  # learner recompute vs SGLang in float32 (the rollout tests' bound)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]
FIGURES = ("prob_scatter.png", "log_ppl_scatter.png", "mismatch_vs_prob.png", "log_ratio_hist.png")


def _prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return str(path)


@pytest.mark.sglang
@pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first")
def test_run_against_a_running_server_passes_the_gate_and_fails_an_impossible_one(sglang_dense, tmp_path):
    common = ["run", "--engine", "sglang", "--server-url", sglang_dense.manager.urls[0],
              "--model", sglang_dense.model_path, "--prompts", _prompts_file(tmp_path),
              "--n", "2", "--max-new-tokens", "12", "--temperature", "1.0"]
    out = tmp_path / "pass"
    assert main(common + ["--out", str(out), "--max-abs-log-ratio", str(ALIGN_TOL)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["overall"]["num_tokens"] == len(PROMPTS) * 2 * 12
    assert report["gate"]["passed"] and report["overall"]["abs_log_ratio_max"] <= ALIGN_TOL
    assert report["meta"]["engine"] == "SGLangEngine"
    assert report["meta"]["weight_version"] == sglang_dense.engine.weight_version
    for name in FIGURES + ("summary.txt",):
        assert (out / name).stat().st_size > 0, name
    # float32 on both sides, but other kernels (torch vs XLA): exact equality on every token
    # is not to be had, so a limit of 1e-12 nats must fail.
    out = tmp_path / "fail"
    assert main(common + ["--out", str(out), "--no-figures", "--max-abs-log-ratio", "1e-12"]) == 1
    report = json.loads((out / "report.json").read_text())
    assert not report["gate"]["passed"] and report["overall"]["abs_log_ratio_max"] > 1e-12


def test_bad_engine_input_exits_2_naming_the_url_or_the_folder(tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nobody listens once the socket closes
    prompts = _prompts_file(tmp_path)
    # The server is probed before any weights load: a folder with a config.json is enough here.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    model = str(tmp_path / "model")
    base = ["run", "--prompts", prompts, "--out", str(tmp_path / "out")]
    assert main(base + ["--model", model, "--engine", "sglang", "--server-url", url]) == 2
    assert f"--server-url {url}" in capsys.readouterr().err
    missing = str(tmp_path / "no-such-model")
    assert main(base + ["--model", missing, "--engine", "sglang", "--launch"]) == 2
    assert f"--model {missing!r} does not exist" in capsys.readouterr().err
    assert main(base + ["--model", model, "--engine", "sglang"]) == 2
    assert "exactly one of --server-url" in capsys.readouterr().err
    assert main(base + ["--model", model, "--server-url", url]) == 2
    assert "add --engine sglang" in capsys.readouterr().err
