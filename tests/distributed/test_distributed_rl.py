"""RL steps of the demo config (embedded sampler) as two processes x 4 CPU devices vs one x 8.

Both runs go through the real command line (``python -m jaxrl.cli train configs/demo.yaml``);
the pair meets through ``--coordinator-address``. The model is the demo's architecture with
random weights, and the reward a format check a random model passes about half the time,
so that the steps have a gradient (the demo's math reward is 0 for an untrained model).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from jax_processes import REPO, child_env

STEPS = 2
# Two processes reduce gradients through gloo in another order than one process does:
# float32 rounding, then AdamW over 2 steps. Measured max |difference| 3.8e-7 (4.2e-7 with data=2 x fsdp=4).
ATOL = 1e-5


def _demo_model_and_data(root, **changes) -> list[str]:
    """Writes the demo's tokenizer and data and a random model of its architecture (with
    ``changes``); returns overrides."""
    from flax import nnx

    from jaxrl.demo import write_demo_files
    from jaxrl.models import Decoder, ModelConfig, save_hf_checkpoint

    paths = write_demo_files(str(root))
    with open(os.path.join(REPO, "configs", "demo_sft.yaml")) as f:
        architecture = {**yaml.safe_load(f)["model"]["architecture"], **changes}
    save_hf_checkpoint(Decoder(ModelConfig(**architecture), rngs=nnx.Rngs(0)), str(root / "hf"))
    return [
        f"model.hf_path={root / 'hf'}", f"data.tokenizer={paths['tokenizer']}",
        f"data.train_files=[{paths['train']}]", "data.eval_files=[]", f"steps={STEPS}",
        "rollout.prompts_per_step=4", f"checkpoint.every={STEPS}", "logging.progress=false",
        "logging.plots=false", "logging.tensorboard=false", "mesh.data=2", "mesh.fsdp=4",
        'reward.tasks={math: {kind: format, pattern: "^[0-9]"}}',
    ]


def _restore_params(directory: str) -> dict[str, np.ndarray]:
    """The parameters of the step-STEPS checkpoint, restored in this process onto one device."""
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    checkpointer = ocp.StandardCheckpointer()
    path = os.path.join(directory, str(STEPS), "state")
    metadata = checkpointer.metadata(path)
    tree = getattr(metadata, "item_metadata", metadata)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=single), tree)
    return _by_path(checkpointer.restore(path, target)["params"])


def _by_path(tree) -> dict[str, np.ndarray]:
    """Leaves keyed by their dict/sequence path ("layers/0/attn/q_proj"), whatever the container types."""
    def name(path):
        keys = [str(getattr(k, "key", getattr(k, "idx", None))) for k in path if hasattr(k, "key") or hasattr(k, "idx")]
        return "/".join(keys[:-1] if keys[-1] == "value" else keys)  # Orbax keeps nnx Variables as {"value": x}

    return {name(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_demo_rl_steps_on_two_processes_equal_one_process_with_eight_devices(processes, tmp_path):
    overrides = _demo_model_and_data(tmp_path)
    train = [sys.executable, "-m", "jaxrl.cli", "train", "configs/demo.yaml", *overrides]
    two, one = tmp_path / "two", tmp_path / "one"
    # fsdp=8 over both processes: each holds only part of every parameter (data=2 x fsdp=4 would
    # give each a full replica), which the Hugging Face export must gather.
    processes.start_group([*train, f"output_dir={two}", f"checkpoint.directory={two / 'ckpt'}",
                           f"checkpoint.export_hf={two / 'hf'}", "mesh.data=1", "mesh.fsdp=8"])
    processes.start([*train, f"output_dir={one}", f"checkpoint.directory={one / 'ckpt'}"], child_env(8))
    results = processes.wait_all(timeout_s=400)
    for result in results:
        assert result.returncode == 0, result.output[-5000:]
    assert results[0].output.count('"metrics":') == 1 and '"metrics":' not in results[1].output  # summary: process 0

    # Process 0 logs the run; process 1 only its own JSONL; no TensorBoard or plots from it.
    two_rows, one_rows = _rows(two / "metrics.jsonl"), _rows(one / "metrics.jsonl")
    assert [r["step"] for r in two_rows] == [r["step"] for r in one_rows] == list(range(1, STEPS + 1))
    own_rows = _rows(two / "process-1" / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"], r["update/loss"]) for r in own_rows] == [
        (r["step"], r["reward/mean"], r["update/loss"]) for r in two_rows]
    assert sorted(os.listdir(two / "process-1")) == ["metrics.jsonl", "run.lock"]  # its own lock (RunLock)
    for a, b in zip(two_rows, one_rows, strict=True):
        assert a["reward/mean"] == b["reward/mean"]  # the same samples
        assert a["update/grad_norm"] > 0.1
        for key in ("update/loss", "update/grad_norm", "update/entropy"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)

    # The checkpoint the two processes wrote together restores here and equals the one-process run.
    two_params, one_params = _restore_params(str(two / "ckpt")), _restore_params(str(one / "ckpt"))
    assert len(two_params) == len(one_params) > 0
    for name in two_params:
        np.testing.assert_allclose(two_params[name], one_params[name], rtol=0, atol=ATOL, err_msg=name)

    # The Hugging Face export of the two processes (parameters spread over both) loads here and holds
    # exactly the parameters of their checkpoint.
    from jaxrl.models import load_hf_checkpoint

    exported = _by_path(nnx.state(load_hf_checkpoint(str(two / "hf")), nnx.Param))
    assert exported.keys() == two_params.keys()
    for name in exported:
        np.testing.assert_array_equal(exported[name], two_params[name], err_msg=name)


def test_moe_routing_replay_on_two_processes_equals_one_process(processes, tmp_path):
    """The engine's routes travel in the step batch spread over two processes (expert=4 x fsdp=2):
    the replayed update equals one process's, and so do the route-disagreement metrics."""
    layers = 2
    overrides = _demo_model_and_data(tmp_path, num_layers=layers, mlp_types=["moe"] * layers, num_experts=8,
                                     num_experts_per_tok=2, moe_intermediate_size=32)
    train = [sys.executable, "-m", "jaxrl.cli", "train", "configs/demo.yaml", *overrides,
             "update.routing_replay=true", "mesh.data=1", "mesh.fsdp=2", "mesh.expert=4"]
    two, one = tmp_path / "two", tmp_path / "one"
    processes.start_group([*train, f"output_dir={two}", f"checkpoint.directory={two / 'ckpt'}"])
    processes.start([*train, f"output_dir={one}", f"checkpoint.directory={one / 'ckpt'}"], child_env(8))
    for result in processes.wait_all(timeout_s=400):
        assert result.returncode == 0, result.output[-5000:]
    for a, b in zip(_rows(two / "metrics.jsonl"), _rows(one / "metrics.jsonl"), strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["routing/disagreement"] == b["routing/disagreement"]
        np.testing.assert_allclose(a["update/loss"], b["update/loss"], rtol=1e-5, atol=1e-6)
    two_params, one_params = _restore_params(str(two / "ckpt")), _restore_params(str(one / "ckpt"))
    assert any("router" in name for name in two_params)
    for name in two_params:
        np.testing.assert_allclose(two_params[name], one_params[name], rtol=0, atol=ATOL, err_msg=name)


def test_partial_rollouts_on_two_processes_equal_one_process(processes, tmp_path):
    """``rollout.partial_tokens``: generations in rounds of 2 tokens, 8 groups in flight for steps of 4
    (the partial queue runs in the trainer's thread on every process), so step 2 trains on groups
    generated with step 1's weights, as on one process: the same samples, per-token weight versions,
    losses and parameters."""
    overrides = _demo_model_and_data(tmp_path)
    train = [sys.executable, "-m", "jaxrl.cli", "train", "configs/demo.yaml", *overrides,
             "rollout.partial_tokens=2", "rollout.partial_groups=8"]
    two, one = tmp_path / "two", tmp_path / "one"
    processes.start_group([*train, f"output_dir={two}", f"checkpoint.directory={two / 'ckpt'}"])
    processes.start([*train, f"output_dir={one}", f"checkpoint.directory={one / 'ckpt'}"], child_env(8))
    for result in processes.wait_all(timeout_s=400):
        assert result.returncode == 0, result.output[-5000:]
    two_rows, one_rows = _rows(two / "metrics.jsonl"), _rows(one / "metrics.jsonl")
    assert two_rows[-1]["rollout/token_staleness_max"] >= 1  # step 2 trained on tokens of step 1's weights
    for a, b in zip(two_rows, one_rows, strict=True):
        for key in ("reward/mean", "rollout/partial_carried_in", "rollout/partial_samples",
                    "rollout/token_staleness_mean"):
            assert a[key] == b[key], key
        np.testing.assert_allclose(a["update/loss"], b["update/loss"], rtol=1e-5, atol=1e-6)
    two_params, one_params = _restore_params(str(two / "ckpt")), _restore_params(str(one / "ckpt"))
    for name in two_params:
        np.testing.assert_allclose(two_params[name], one_params[name], rtol=0, atol=ATOL, err_msg=name)
