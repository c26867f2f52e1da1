"""Full RL steps with SGLang on a two-host layout: two processes, each with 2 learner devices and one
real CPU SGLang server of its own (``placement``), against one process with the same 4 learner
devices and two servers, or one (greedy tokens do not depend on which server draws them).

Each run is ``jaxrl train`` (through tests/distributed/cluster_worker.py, which can kill a server
mid-rollout): every process draws its share of the step's prompts on its own server, the
samples are gathered, the update runs on the 4-device mesh, and each process pushes the new
weights in memory to its own server, whose probe must then match the learner's recompute.
Sampling is greedy (``rollout.top_k=1``: SGLang draws its seeded samples only under
``--enable-deterministic-inference``, which it refuses for the CPU attention backend), so runs
that agree draw the same tokens; a scaled random model (``matrix_scale=10``) has peaked
distributions, so float32 reduction-order differences between meshes never flip a token; the
REINFORCE estimator gives prompts whose greedy answers differ different advantages.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest
import yaml

from jax_processes import REPO, child_env
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON
from server_ports import free_base_port
from test_distributed_rl import _restore_params

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first"),
]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_worker.py")
STEPS = 2
# Process 1 sends 4 /generate requests a step (8 prompts, half each): the 6th is step 2's second.
KILL_AT = 6
ATOL = 1e-5  # parameters after 3 steps: float32 reductions in another order (as test_distributed_rl)
METRICS = ("update/loss", "update/grad_norm", "recompute/entropy")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from jaxrl.demo import write_demo_files
    from jaxrl.models import ModelConfig
    from jaxrl.rollout.sglang.testing import write_random_checkpoint

    root = tmp_path_factory.mktemp("cluster")
    paths = write_demo_files(str(root))
    with open(os.path.join(REPO, "configs", "demo_sft.yaml")) as f:
        architecture = yaml.safe_load(f)["model"]["architecture"]
    write_random_checkpoint(str(root / "hf"), ModelConfig(**architecture), seed=0, matrix_scale=10.0)
    return root, paths


def _train_args(files, out, hosts: int, devices_per_host: int, learner: list[int], **extra) -> list[str]:
    root, paths = files
    args = [
        "configs/demo.yaml", f"output_dir={out}", f"checkpoint.directory={out / 'ckpt'}", "checkpoint.every=1",
        "checkpoint.keep=5", f"model.hf_path={root / 'hf'}", f"data.tokenizer={paths['tokenizer']}",
        f"data.train_files=[{paths['train']}]", "data.eval_files=[]", f"steps={STEPS}",
        "rollout.prompts_per_step=8", "rollout.group_size=1", "rollout.top_k=1", "advantage.estimator=reinforce",
        'reward.tasks={math: {kind: format, pattern: "^[0-9]"}}', "optimizer.lr=1e-3",
        "logging.progress=false", "logging.plots=false", "logging.tensorboard=false",
        "mesh.data=1", "mesh.fsdp=4", "rollout.engine=sglang",
        f"rollout.sglang.server.model_path={root / 'hf'}", f"rollout.sglang.server.base_port={free_base_port(2)}",
        f"rollout.sglang.server.log_dir={out / 'servers'}", "rollout.sglang.server.startup_timeout_s=300",
        f"rollout.sglang.push.checkpoint_dir={out / 'pushed'}", "rollout.sglang.push.probe_ids=[1, 5, 9, 3, 12]",
        f"placement={{hosts: {hosts}, devices_per_host: {devices_per_host}, learner_devices: {learner}}}",
    ]
    return args + [f"{k}={v}" for k, v in extra.items()]


def _run(processes, files, out, hosts: int, kill_at: int = 0, resume: bool = False, servers: int = 1,
         **extra) -> list:
    """``jaxrl train`` as ``hosts`` processes (2 learner devices + 1 server each) or as one process
    with 4 learner devices and ``servers`` servers; returns the metrics rows of process 0."""
    if hosts == 2:
        args = _train_args(files, out, 2, 3, [0, 1], **extra)
        processes.start_group([sys.executable, WORKER, str(kill_at), *args, *(["--resume"] * resume)],
                              devices=3)
    else:
        args = _train_args(files, out, 1, 4 + servers, [0, 1, 2, 3], **extra)
        processes.start([sys.executable, WORKER, "0", *args, *(["--resume"] * resume)], child_env(4 + servers))
    for result in processes.wait_all(timeout_s=900):
        assert result.returncode == 0, result.output[-6000:]
    processes.forget()
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _same_run(a_rows, b_rows, a_dir, b_dir) -> None:
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows] == list(range(1, STEPS + 1))
    for a, b in zip(a_rows, b_rows, strict=True):
        # The same samples: greedy tokens, so the same rewards and lengths exactly.
        for key in ("reward/mean", "rollout/response_length_mean"):
            assert a[key] == b[key], (key, a["step"])
        for key in METRICS:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
        assert a["push/probe_max_abs_diff"] <= 1e-5 and b["push/probe_max_abs_diff"] <= 1e-5
    a_params, b_params = _restore_params(str(a_dir / "ckpt")), _restore_params(str(b_dir / "ckpt"))
    assert a_params.keys() == b_params.keys() and a_params
    for name in a_params:
        np.testing.assert_allclose(a_params[name], b_params[name], rtol=0, atol=ATOL, err_msg=name)


def test_two_hosts_each_with_its_own_server_train_as_one_host_with_both(processes, files, tmp_path):
    """Synchronous steps; process 1's server is killed in step 2's rollout: it is restarted, given the
    pushed weights again, and the step's samples are those of the one-process run: none lost or
    duplicated. The push is in memory: nothing is written to the push folder. No server but the
    killed one ever restarts, the one-process run's two servers included: before, a chunk handed
    to two servers was one payload both read, the second one's release deleted the pusher's
    shared files, and the next push killed the server that could not open them (44 s a push,
    silently restarted)."""
    two, one = tmp_path / "two", tmp_path / "one"
    two_rows = _run(processes, files, two, hosts=2, kill_at=KILL_AT)
    one_rows = _run(processes, files, one, hosts=1, servers=2)
    _same_run(two_rows, one_rows, two, one)
    assert all(row["update/grad_norm"] > 0 for row in two_rows)  # rewards differ between prompts: real updates
    for row in two_rows:
        assert row["push/chunks"] >= 1 and row["push/bytes"] > 0
    assert not (two / "pushed").exists() and not (one / "pushed").exists()
    # Process 1's server was restarted once; no other server ever.
    assert _starts(two) == [1, 2] and _starts(one) == [1, 1]


def _starts(run) -> list[int]:
    """How often each server of a run was started, in port order (one log per server)."""
    logs = sorted((run / "servers").iterdir())
    return [log.read_text().count("===== jaxrl: start #") for log in logs]


def test_async_on_two_hosts_equals_one_host_and_resumes_exactly(processes, files, tmp_path):
    """``rollout.max_staleness=1``: each process draws its share of the next batch in a background
    thread while the update runs, and the samples are gathered in the trainer's thread. Equal to
    the one-process run; and the two-process run resumed from its step-1 checkpoint (the batch in
    flight saved with it) ends where the straight run did."""
    two, one, resumed = tmp_path / "two", tmp_path / "one", tmp_path / "resumed"
    two_rows = _run(processes, files, two, hosts=2, **{"rollout.max_staleness": 1})
    one_rows = _run(processes, files, one, hosts=1, **{"rollout.max_staleness": 1})
    _same_run(two_rows, one_rows, two, one)
    assert [r["rollout/staleness_max"] for r in two_rows] == [0, 1]
    assert _starts(two) == [1, 1] and _starts(one) == [1]
    # The straight run's checkpoint of step 1, then --resume: step 2 as the straight run made it.
    shutil.copytree(two / "ckpt", resumed / "ckpt", ignore=lambda folder, names: [str(STEPS)] if str(STEPS) in names
                    else [])
    resumed_rows = _run(processes, files, resumed, hosts=2, resume=True, **{"rollout.max_staleness": 1})
    assert [r["step"] for r in resumed_rows] == [STEPS]
    for key in ("reward/mean", "rollout/response_length_mean", *METRICS):
        assert resumed_rows[0][key] == two_rows[-1][key], key
    straight, again = _restore_params(str(two / "ckpt")), _restore_params(str(resumed / "ckpt"))
    for name in straight:
        np.testing.assert_array_equal(straight[name], again[name], err_msg=name)
