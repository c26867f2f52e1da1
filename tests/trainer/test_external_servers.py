"""``jaxrl train`` against SGLang servers someone else started: given by URL, the API key from the
environment, the weights pushed over a torch process group (SGLang's ``/init_weights_update_group``
and ``/update_weights_from_distributed``; gloo, since the server runs on CPU), no file written.

The server is the suite's ``sglang_dense`` (tests/conftest.py), started with an API key; this test
is its user from outside, and gives the fleet its own weights back at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first"),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 2


def test_train_against_servers_started_elsewhere_pushes_over_a_process_group(sglang_dense, tmp_path):
    from jaxrl.demo import write_demo_files
    from jaxrl.models import load_hf_checkpoint
    from jaxrl.models.scoring import sequence_logprobs

    files = write_demo_files(str(tmp_path / "demo"))
    url, log = sglang_dense.manager.urls[0], sglang_dense.manager.log_path(0)
    log_before = log.read_text()
    out = tmp_path / "run"
    args = [
        "configs/demo.yaml", f"output_dir={out}", f"checkpoint.directory={out / 'ckpt'}",
        f"checkpoint.export_hf={out / 'hf'}", f"model.hf_path={sglang_dense.model_path}",
        f"data.tokenizer={files['tokenizer']}", f"data.train_files=[{files['train']}]", "data.eval_files=[]",
        f"steps={STEPS}", "rollout.prompts_per_step=4", "rollout.group_size=4",
        'reward.tasks={math: {kind: format, pattern: "^[0-9]"}}', "logging.progress=false", "logging.plots=false",
        "logging.tensorboard=false", "rollout.engine=sglang", f"rollout.sglang.external.urls=[{url}]",
        "rollout.sglang.push.method=distributed", f"rollout.sglang.push.checkpoint_dir={out / 'pushed'}",
        "rollout.sglang.push.probe_ids=[1, 5, 9, 3, 12]",
    ]
    try:
        # The key reaches jaxrl from the environment only (the autouse fixture set it for this process).
        assert os.environ["JAXRL_SGLANG_API_KEY"] == sglang_dense.manager.api_key
        dry = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", *args, "--dry-run"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert dry.returncode == 0 and f"SGLang servers started elsewhere: {url}" in dry.stdout, dry.stderr
        result = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", *args], cwd=REPO, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-5000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        for row in rows:
            assert row["push/probe_max_abs_diff"] <= 1e-5 and row["push/chunks"] >= 1 and row["push/bytes"] > 0
            assert row["mismatch/abs_log_ratio_max"] < 1e-4  # the server sampled with the pushed weights
        assert not (out / "pushed").exists()
        # The server serves the run's last weights: its logprobs are the exported model's.
        probe = [1, 5, 9, 3, 12, 7, 2]
        want = sequence_logprobs(load_hf_checkpoint(str(out / "hf")), np.asarray([probe]), np.asarray([len(probe)]))
        got = sglang_dense.engine.score(probe)
        assert np.max(np.abs(got - want[0, 1:])) <= 1e-5
        traffic = log.read_text()[len(log_before):]
        for route in ("/init_weights_update_group", "/update_weights_from_distributed",
                      "/destroy_weights_update_group"):
            assert f'"POST {route} HTTP/1.1" 200' in traffic, route
        assert "/update_weights_from_disk" not in traffic and "/update_weights_from_tensor" not in traffic
    finally:
        sglang_dense.engine.update_weights(sglang_dense.model, "after-external-run")  # the fleet's own again
