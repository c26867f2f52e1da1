"""``jaxrl compile`` for real TPU topologies on this CPU (libtpu in ``.venv-tpu``, no TPU).

Each test runs the command in ``.venv-tpu``'s interpreter, as a user would: a demo-size dense model
and a small Qwen3-MoE compile every program of an RL step (train step with micro-batches and remat,
scorers, embedded sampler) for v5e and v5p slices over data, fsdp, tensor and expert axes, with the
Pallas kernels in the compiled programs (splash attention inside ``shard_map``; the experts' megablox
``gmm`` forward and ``tgmm`` weight gradient), and each model's train step compiles for the other
topology too; an SFT curriculum's config compiles one train step per stage length, its rows split along
the ``sequence`` axis; an oversized model is refused with exit 1 and the keys that would help.
"""

import pytest

from aot_runs import ARCHITECTURE, MOE, OVERSIZED, TPU_PYTHON, compile_config, programs_by_name, rl_config, sft_config

pytestmark = pytest.mark.skipif(not TPU_PYTHON.exists(), reason="run scripts/setup_tpu_aot.sh first")

# The splash kernels by the start of the names XLA gives them in the compiled HLO
# (jaxrl.compile.aot.mosaic_kernels): splash_mqa_fwd_segmented_no_residuals, ...
SPLASH_FORWARD = ("splash_mqa_fwd",)
SPLASH_BACKWARD = ("splash_mqa_dq", "splash_mqa_dkv")


def _config(tmp_path, architecture, mesh, **kwargs) -> str:
    return rl_config(tmp_path, architecture, mesh, attention_impl="splash", **kwargs)


def _compile(config: str, topology: str, tmp_path, *extra):
    return compile_config(TPU_PYTHON, config, topology, tmp_path, *extra)


def _has_kernels(program: dict, *prefixes: str) -> bool:
    """Whether the compiled program calls, for each prefix, a Mosaic kernel whose name starts with it."""
    return all(any(k.startswith(prefix) for k in program["kernels"]) for prefix in prefixes)


def test_dense_model_compiles_for_v5e_over_fsdp_and_tensor(tmp_path):
    config = _config(tmp_path, ARCHITECTURE, {"fsdp": 2, "tensor": 2},
                     objective={"kl_kind": "k3-as-loss", "kl_coef": 0.01})
    done, report = _compile(config, "v5e:2x2", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    programs = programs_by_name(report)
    assert report["chip"]["name"] == "v5e" and report["devices"] == 4 and report["fits"]
    assert set(programs) == {"train_step", "old_logprob_scorer", "reference_scorer", "sampler"}
    # T = 64 + 192 - 1 = 255 > one 128 block: the splash kernels are in the compiled programs (and XLA
    # does not count their FLOPs), forward and backward in the train step.
    assert "attention splash" in programs["train_step"]["what"]
    print({name: program["kernels"] for name, program in programs.items()})
    assert _has_kernels(programs["old_logprob_scorer"], *SPLASH_FORWARD)
    assert _has_kernels(programs["train_step"], *SPLASH_FORWARD, *SPLASH_BACKWARD)
    assert programs["train_step"]["kernel_flops_per_device"] > 0
    assert programs["old_logprob_scorer"]["kernel_flops_per_device"] > 0
    for program in programs.values():
        assert 0 < program["total_bytes"] < report["hbm_bytes_per_device"] and program["roofline_seconds"] > 0
    # The reference holds a copy of the weights beside every program.
    assert programs["train_step"]["resident_bytes"] > 0
    assert "v5e 16 GiB" in report["hbm_source"]


def test_moe_model_compiles_for_v5p_over_data_fsdp_and_expert(tmp_path):
    config = _config(tmp_path, MOE, {"data": 2, "fsdp": 2, "expert": 2})
    done, report = _compile(config, "v5p:2x2x2", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["chip"]["name"] == "v5p" and report["devices"] == 8 and report["fits"]
    programs = programs_by_name(report)
    assert {"train_step", "old_logprob_scorer", "sampler"} <= set(programs)
    assert "fits: smallest headroom" in done.stdout
    # The experts run in megablox kernels: gmm forward everywhere, tgmm (the weight gradient) in the step.
    print({name: program["kernels"] for name, program in programs.items()})
    assert _has_kernels(programs["train_step"], "gmm", "tgmm")
    assert _has_kernels(programs["old_logprob_scorer"], "gmm") and _has_kernels(programs["sampler"], "gmm")
    # Their FLOPs are added analytically: 2 x tokens x k x 3*D*I per MoE layer forward, 2x backward.
    rows, length = 8 * 4 // 2, 64 + 192 - 1
    experts = 2 * 3 * MOE["hidden_size"] * MOE["num_experts_per_tok"] * MOE["moe_intermediate_size"]
    assert programs["train_step"]["kernel_flops_per_device"] >= 6 * experts * rows * length / 8


@pytest.mark.parametrize("architecture, topology, mesh, scan_layers", [
    (ARCHITECTURE, "v5p:2x2x2", {"data": 2, "fsdp": 2, "tensor": 2}, False),
    (MOE, "v5e:2x2", {"fsdp": 2, "expert": 2}, True),
], ids=["dense-v5p", "moe-v5e-scanned"])
def test_each_models_train_step_compiles_for_the_other_topology(tmp_path, architecture, topology, mesh, scan_layers):
    """The MoE step with ``model.scan_layers`` (as the 30B config): the kernels lower inside the scanned body."""
    done, report = _compile(_config(tmp_path, architecture, mesh, scan_layers=scan_layers), topology, tmp_path,
                            "--only", "train_step")
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["fits"] and report["devices"] == (8 if topology.startswith("v5p") else 4)
    train_step = programs_by_name(report)["train_step"]
    assert _has_kernels(train_step, *SPLASH_FORWARD, *SPLASH_BACKWARD)
    assert ("moe" in architecture.get("mlp_types", ())) == _has_kernels(train_step, "gmm", "tgmm")


def test_oversized_model_is_refused_with_the_keys_that_help(tmp_path):
    # 18 GiB per v5e device of 16 over fsdp = 4
    config = _config(tmp_path, OVERSIZED, {"fsdp": 4})
    done, report = _compile(config, "v5e:2x2", tmp_path, "--only", "train_step")
    assert done.returncode == 1, done.stderr[-3000:]
    assert not report["fits"] and not programs_by_name(report)["train_step"]["fits"]
    line = next(x for x in done.stderr.splitlines() if "does not fit: train_step" in x)
    for needle in ("GiB per device", "16.00 GiB HBM", "update.micro_batches", "model.remat", "mesh.fsdp"):
        assert needle in line, line


def test_bad_input_exits_2(tmp_path):
    config = _config(tmp_path, ARCHITECTURE, {"fsdp": 2, "tensor": 2})
    done, _ = _compile(config, "v5e:9x9x9x9", tmp_path)
    assert done.returncode == 2 and "--topology 'v5e:9x9x9x9'" in done.stderr
    done, _ = _compile(config, "v5p:2x2x2", tmp_path)  # 8 devices, a mesh of 4
    assert done.returncode == 2 and "mesh.*" in done.stderr
    packed = sft_config(tmp_path, ARCHITECTURE, {"fsdp": 4}, [{"steps": 5, "max_length": 256}], sft={"pack": True})
    done, _ = _compile(packed, "v5e:2x2", tmp_path)
    assert done.returncode == 2 and "sft.pack=true" in done.stderr


def test_an_sft_curriculum_compiles_a_train_step_per_stage_length(tmp_path):
    """What ``jaxrl sft`` runs: a stage of 512 and one of 4,096 tokens (given twice: one program) on
    ``fsdp=2 x sequence=2`` with Ulysses; each row's 2 x 256 or 2 x 2,048 tokens per chip. The long
    stage is long enough for its activations to outweigh what every step holds whatever its length
    (at 2,048 they did not: 11.7 against 12.8 MB of temporaries, once each chip ran the LM head on
    its own tokens)."""
    stages = [{"steps": 5, "max_length": 512}, {"steps": 5, "max_length": 4096}, {"steps": 5, "max_length": 4096}]
    config = sft_config(tmp_path, dict(ARCHITECTURE, max_position_embeddings=4096), {"fsdp": 2, "sequence": 2},
                        stages, attention_impl="splash")
    done, report = _compile(config, "v5e:2x2", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    programs = programs_by_name(report)
    assert set(programs) == {"sft_step_512", "sft_step_4096"}
    # 4 rows (sft.batch_size) of max_length - 1 next-token columns, rounded up to the 2 sequence shards
    assert "4 rows x 512 tokens in 2 micro-batches" in programs["sft_step_512"]["what"]
    assert "4 rows x 4096 tokens in 2 micro-batches" in programs["sft_step_4096"]["what"]
    for program in programs.values():
        assert _has_kernels(program, *SPLASH_FORWARD, *SPLASH_BACKWARD), program["kernels"]
        assert program["fits"] and program["model_flops_per_device"] > 0
    # 8x the tokens: more activation memory, and at least 8x the model FLOPs (attention grows faster)
    assert programs["sft_step_4096"]["temp_bytes"] > programs["sft_step_512"]["temp_bytes"]
    assert programs["sft_step_4096"]["model_flops_per_device"] > 8 * programs["sft_step_512"]["model_flops_per_device"]
