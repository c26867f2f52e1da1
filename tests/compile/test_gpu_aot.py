"""``jaxrl compile`` for NVIDIA GPU topologies on this CPU (the JAX CUDA plugin in ``.venv-cuda-aot``, no GPU).

Each test runs the command in ``.venv-cuda-aot``'s interpreter, as a user would: a demo-size dense model and
a small Qwen3-MoE compile every program of an RL step for H100 and H200 topologies (one host and two), with
``attention_impl: auto``, which on a GPU mesh is cuDNN's fused attention: its forward and backward custom
calls are in the compiled train step, the forward in the scorer; the sampler's KV-cache attention runs
``chunked``. A placement's learner share is what is compiled; an oversized model is refused with exit 1 and
the keys that would help; a bad topology name exits 2 naming the accepted ones.
"""

import pytest

from aot_runs import ARCHITECTURE, CUDA_PYTHON, MOE, OVERSIZED, compile_config, programs_by_name, rl_config

pytestmark = pytest.mark.skipif(not CUDA_PYTHON.exists(), reason="run scripts/setup_cuda_aot.sh first")

# cuDNN's fused attention in compiled GPU HLO: custom_call_target="__cudnn$fmhaSoftmax" and its backward.
CUDNN_FORWARD, CUDNN_BACKWARD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"


def _compile(config: str, topology: str, tmp_path, *extra):
    return compile_config(CUDA_PYTHON, config, topology, tmp_path, *extra)


def test_dense_model_compiles_for_h100_with_cudnn_attention(tmp_path):
    config = rl_config(tmp_path, ARCHITECTURE, {"fsdp": 4, "tensor": 2}, evaluate=True,
                       objective={"kl_kind": "k3-as-loss", "kl_coef": 0.01})
    done, report = _compile(config, "h100:1x8", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["chip"]["name"] == "NVIDIA H100 80GB HBM3" and report["devices"] == 8 and report["fits"]
    # JAX's default share of the GPU's memory is the budget
    assert report["hbm_bytes_per_device"] == pytest.approx(0.75 * 84_942_979_072)
    programs = programs_by_name(report)
    assert set(programs) == {"train_step", "old_logprob_scorer", "reference_scorer", "sampler", "eval_sampler"}
    train = programs["train_step"]
    assert "attention cudnn" in train["what"]  # auto on a GPU mesh
    assert {CUDNN_FORWARD, CUDNN_BACKWARD} <= set(train["kernels"])
    assert CUDNN_FORWARD in programs["old_logprob_scorer"]["kernels"]
    assert CUDNN_BACKWARD not in programs["old_logprob_scorer"]["kernels"]
    assert not any(k.startswith("__cudnn$fmha") for k in programs["sampler"]["kernels"])  # the cache: chunked
    # cuDNN's FLOPs are a custom call's: counted analytically, as splash's are on TPU
    assert train["kernel_flops_per_device"] > 0


def test_chunked_attention_has_no_cudnn_call(tmp_path):
    config = rl_config(tmp_path, ARCHITECTURE, {"fsdp": 8}, attention_impl="chunked")
    done, report = _compile(config, "h100:1x8", tmp_path, "--only", "train_step")
    assert done.returncode == 0, done.stderr[-3000:]
    train = programs_by_name(report)["train_step"]
    assert "attention chunked" in train["what"]
    assert not any(k.startswith("__cudnn$fmha") for k in train["kernels"])


def test_moe_model_compiles_for_two_h200_hosts_over_fsdp_and_expert(tmp_path):
    config = rl_config(tmp_path, MOE, {"fsdp": 4, "expert": 2})
    done, report = _compile(config, "h200:2x4", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["chip"]["name"] == "NVIDIA H200" and report["devices"] == 8 and report["fits"]
    train = programs_by_name(report)["train_step"]
    assert {CUDNN_FORWARD, CUDNN_BACKWARD} <= set(train["kernels"])


def test_a_placement_compiles_the_learners_share(tmp_path):
    """2 hosts x 8 GPUs, 4 of each host's for the learner (the rest are SGLang's): 8 learner devices, and
    the learner's memory share is the budget."""
    placement = {"hosts": 2, "devices_per_host": 8, "learner_devices": [0, 1, 2, 3], "learner_memory_fraction": 0.9}
    config = rl_config(tmp_path, ARCHITECTURE, {"fsdp": 8}, placement=placement,
                       rollout={"engine": "sglang", "prompts_per_step": 8, "group_size": 4, "max_new_tokens": 192,
                                "sglang": {"server": {"model_path": "unused", "device": "cuda"}}})
    done, report = _compile(config, "h100:2x8", tmp_path, "--only", "train_step")
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["devices"] == 8 and report["mesh"]["fsdp"] == 8
    assert report["hbm_bytes_per_device"] == pytest.approx(0.9 * 84_942_979_072)
    done, _ = _compile(config, "h100:1x8", tmp_path)
    assert done.returncode == 2 and "placement is 2 x 8" in done.stderr


def test_oversized_model_is_refused_with_the_keys_that_help(tmp_path):
    config = rl_config(tmp_path, OVERSIZED, {"fsdp": 2})  # 38 GiB of weights and AdamW moments per GPU alone
    done, report = _compile(config, "a100:1x2", tmp_path, "--only", "train_step")
    assert done.returncode == 1, done.stderr[-3000:]
    assert not report["fits"] and not programs_by_name(report)["train_step"]["fits"]
    line = next(x for x in done.stderr.splitlines() if "does not fit: train_step" in x)
    for needle in ("GiB per device", "NVIDIA A100-SXM4-80GB device has 59.44 GiB HBM", "update.micro_batches",
                   "model.remat", "mesh.fsdp"):
        assert needle in line, line


@pytest.mark.parametrize("topology,message", [
    ("h900:1x8", "unknown GPU 'h900'; GPU topologies are CHIP:HOSTSxGPUS with CHIP one of a100, b200, h100, h200"),
    ("h100:8", "a GPU topology is CHIP:HOSTSxGPUS, e.g. h100:2x8"),
    ("h100:1x16", "GPUS (per host) 1 to 8"),
    ("h100:1x4", "has 8 devices but the topology has 4"),
])
def test_bad_topology_exits_2_naming_what_is_accepted(tmp_path, topology, message):
    config = rl_config(tmp_path, ARCHITECTURE, {"fsdp": 8})
    done, _ = _compile(config, topology, tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
