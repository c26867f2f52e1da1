"""The programs one RL step runs (or an SFT curriculum's train steps), lowered from the trainer's own functions
and compiled for a topology.

Nothing is allocated: the model is built with ``nnx.eval_shape``, the train state, batches and
sampler inputs are ``jax.ShapeDtypeStruct``s carrying the shardings the trainer gives them
(``jaxrl.models.sharding``'s logical rules over the topology's mesh), and each program is the
trainer's: :class:`~jaxrl.trainer.update.TrainStep` over ``rl_loss_fn`` (the config's micro-batches,
remat policy and attention implementation; for an SFT config one per stage length over ``sft_loss_fn``),
:meth:`LogprobScorer.lower` (old-logprob and reference
scorers: one program, two parameter trees) and :meth:`JaxSampler.lower` (prefill + decode loop at the
trainer's batch and lengths). ``compile()`` runs XLA for the topology's chips (libtpu, .venv-tpu).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.compile import gpus
from jaxrl.errors import InputError
from jaxrl.models import Decoder, ModelConfig, make_mesh
from jaxrl.models.attention import resolve_attention_impl
from jaxrl.models.scoring import LogprobScorer
from jaxrl.models.sharding import batch_devices, sequence_row_length
from jaxrl.rollout.sampler import JaxSampler
from jaxrl.trainer.batch import StepBatch, UpdateBatch
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.sft import sft_loss_fn, stage_row_length
from jaxrl.trainer.stages import frozen_policy_steps, objective_for_run, sampler_batch
from jaxrl.trainer.update import abstract_train_state, build_optimizer, build_train_step, rl_loss_fn


def topology_devices(name: str, slices: int = 1, placement=None) -> list:
    """The devices of topology ``name``: a GPU one (``h100:2x8``, jaxrl.compile.gpus) or a TPU one as JAX
    spells it (``v5p:4x4x2``, ``v5e:2x2``, ``v6e:4x4``, ``v4:2x2x2``) times ``slices`` (multi-slice, DCN
    between slices); InputError for a name neither accepts. With a ``placement`` (a PlacementConfig)
    a GPU topology is the cluster's and the devices are the learner's share: its GPUs on each host."""
    from jax.experimental import topologies

    gpu = gpus.parse_topology(name)
    if gpu is not None:
        chip, hosts, per_host = gpu
        if slices != 1:
            raise InputError("--slices is for TPU multi-slice; a GPU topology names its hosts: CHIP:HOSTSxGPUS")
        if placement is not None:
            if (placement.hosts, placement.devices_per_host) != (hosts, per_host):
                raise InputError(f"--topology {name!r} is {hosts} hosts x {per_host} GPUs but the config's placement "
                                 f"is {placement.hosts} x {placement.devices_per_host}: name the cluster the "
                                 "placement lays out")
            per_host = len(placement.learner_devices)  # what JAX sees on each host: the learner's GPUs
        return gpus.gpu_devices(chip, hosts, per_host)

    try:
        import libtpu  # noqa: F401  (describes TPU topologies; nothing runs on a TPU)
    except ImportError:
        raise InputError("jaxrl compile needs libtpu: run it with .venv-tpu/bin/python (bash scripts/setup_tpu_aot.sh)"
                         ) from None
    if slices < 1:
        raise InputError(f"--slices must be >= 1, got {slices}")
    try:
        kwargs = {"num_slices": slices} if slices > 1 else {}
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs).devices)
    except Exception as e:  # libtpu's own message names the expected form
        raise InputError(f"--topology {name!r}: {' '.join(str(e).split())[:300]}") from None


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: ``lower()`` gives its ``jax.stages.Lowered``; the analytic figures the
    report needs beside XLA's (``model_flops``: the matmul + attention FLOPs of the real work,
    ``kernel_flops``: those of Pallas kernels, which XLA does not count, ``min_hbm_bytes``: HBM traffic
    no schedule avoids, ``resident_bytes``: per-chip buffers alive during the program but not its
    arguments, e.g. the optimizer state while the sampler runs)."""

    name: str
    what: str
    lower: Callable[[], Any]
    model_flops: float
    kernel_flops: float = 0.0
    min_hbm_bytes: float = 0.0
    resident_bytes: int = 0
    same_as: str = ""  # a program compiled already under that name (the reference scorer)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program's compiled figures, per device."""

    program: Program
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    xla_flops: float
    compile_seconds: float
    refused: str = ""  # XLA's own out-of-memory message when it refused to compile (temp_bytes: what it asked for)
    kernels: tuple[str, ...] = ()  # the kernels XLA did not generate (Mosaic, cuDNN, cuBLAS): kernels_called()

    @property
    def total_bytes(self) -> int:
        """Peak HBM of the program: arguments + outputs (less donated aliases) + temporaries + code +
        what stays resident beside it."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes
                + self.program.resident_bytes)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def matmul_params(c: ModelConfig) -> float:
    """Weights one token multiplies by (active experts only; the LM head, not the embedding lookup)."""
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    dense = 3 * c.hidden_size * c.intermediate_size
    moe = c.hidden_size * c.num_experts + 3 * c.hidden_size * (
        c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size)
    mlps = sum(moe if kind == "moe" else dense for kind in (c.mlp_types or ("dense",) * c.num_layers))
    return c.num_layers * attention + mlps + c.hidden_size * c.vocab_size


def grouped_expert_params(c: ModelConfig) -> float:
    """The part of :func:`matmul_params` a token multiplies by in the routed experts' grouped
    matmuls: on TPU the megablox ``gmm`` / ``tgmm`` Pallas kernels, which XLA does not count."""
    moe_layers = sum(kind == "moe" for kind in (c.mlp_types or ()))
    return moe_layers * 3.0 * c.hidden_size * c.num_experts_per_tok * c.moe_intermediate_size


def attention_flops(c: ModelConfig, sequences: int, length: int) -> float:
    """Causal softmax-attention forward FLOPs of ``sequences`` rows of ``length`` tokens: QK^T and PV,
    ``2 * 2 * B * H * T * T * D / 2`` per layer (half the square is masked)."""
    layers = sum(kind == "full_attention" for kind in (c.layer_types or ("full_attention",) * c.num_layers))
    return layers * 2.0 * sequences * c.num_heads * length * length * c.head_dim


BACKWARD_ATTENTION = 2.5  # the backward of attention costs ~2.5x its forward (dQ, dK, dV and the recompute of P)


def step_shapes(config: TrainConfig, mesh) -> dict[str, int]:
    """The trainer's static shapes (jaxrl.trainer.rl.RLTrainer): the packed row length, rows per
    optimizer step, per scorer call and per sampler call."""
    r, u = config.rollout, config.update
    sequences = r.prompts_per_step * r.group_size
    if sequences % (u.mini_batches * u.micro_batches):
        raise InputError(f"rollout.prompts_per_step x group_size = {sequences} sequences do not split into "
                         f"update.mini_batches x micro_batches = {u.mini_batches} x {u.micro_batches}")
    return {"length": sequence_row_length(config.data.max_prompt_tokens + r.max_new_tokens - 1, mesh,
                                          config.model.row_chunks()),
            "sequences": sequences, "update_rows": sequences // u.mini_batches,
            "score_rows": sequences // (u.mini_batches * u.micro_batches),
            "max_batch": sampler_batch(config)}


def abstract_update_batch(rows: int, length: int, *, reference: bool) -> UpdateBatch:
    """The UpdateBatch one optimizer step gets (StepBatch.mini_batches without packing), abstract."""
    ints = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    floats = jax.ShapeDtypeStruct((rows, length), jnp.float32)
    tokens = StepBatch(input_ids=ints, positions=ints, segment_ids=ints, targets=ints, mask=floats,
                       rollout_logp=floats, old_logp=floats, ref_logp=floats if reference else None,
                       advantages=floats)
    return UpdateBatch(tokens=tokens, normalizer=jax.ShapeDtypeStruct((), jnp.float32),
                       key_seed=jax.ShapeDtypeStruct((), jnp.int32))


def _abstract_learner(config: TrainConfig, model_config: ModelConfig, devices: list):
    """The mesh over ``devices`` and the model's graph and abstract parameters (nothing allocated)."""
    if config.mesh.size != len(devices):
        raise InputError(f"mesh {dataclasses.asdict(config.mesh)} has {config.mesh.size} devices but the topology "
                         f"has {len(devices)}: set the mesh.* sizes (key=value overrides) to use all of them")
    mesh = make_mesh(config.mesh, devices)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0))))
    return mesh, graphdef, params


def _kernels(c: ModelConfig, platform: str, length: int) -> tuple[str, bool, float]:
    """What rows of ``length`` run on ``platform``: the attention implementation, whether it is a custom call
    (splash, cuDNN: XLA does not count its FLOPs) and the expert weights a token multiplies by in TPU's
    grouped-matmul kernels (0 elsewhere)."""
    impl = resolve_attention_impl(c.attention_impl, platform, length=length, block_size=c.attention_block_size,
                                  dtype=c.dtype)
    return impl, impl in ("splash", "cudnn"), grouped_expert_params(c) if platform == "tpu" else 0.0


def _train_program(name: str, step, state, batch, c: ModelConfig, platform: str, *, rows: int, length: int,
                   micro_batches: int, resident_bytes: int = 0) -> Program:
    """An optimizer step over ``rows`` rows of ``length`` tokens, with its analytic FLOPs and HBM floor."""
    impl, kernel, experts = _kernels(c, platform, length)
    attention = (1 + BACKWARD_ATTENTION) * attention_flops(c, rows, length)
    return Program(
        name, f"optimizer step: {rows} rows x {length} tokens in {micro_batches} micro-batches, remat {c.remat}, "
        f"attention {impl}" + (", layers scanned" if c.scan_layers else ""),
        lambda: step.lower(state, batch), model_flops=6.0 * matmul_params(c) * rows * length + attention,
        kernel_flops=(attention if kernel else 0.0) + 6.0 * experts * rows * length,
        min_hbm_bytes=2 * per_device_bytes(state), resident_bytes=resident_bytes)


def sft_stage_programs(config: TrainConfig, model_config: ModelConfig, devices: list) -> tuple[list[Program], Any]:
    """The train step of each length of ``config.sft.stages`` (``jaxrl sft``'s curriculum) on ``devices``, and
    the mesh: ``sft.batch_size`` rows of the stage's length in ``sft.micro_batches``, unpacked."""
    if config.sft.pack:
        raise InputError("sft.pack=true: jaxrl compile lowers unpacked rows only; compile with sft.pack=false, an "
                         "upper bound on the packed step's memory")
    mesh, graphdef, params = _abstract_learner(config, model_config, devices)
    sft = config.sft
    optimizer, _ = build_optimizer(config.optimizer, sum(stage.steps for stage in sft.stages))
    step = build_train_step(graphdef, params, optimizer,
                            sft_loss_fn(sft.micro_batches, config.update.logprob_chunk_size), mesh)
    state = abstract_train_state(step, params)
    programs = []
    for max_length in sorted({stage.max_length for stage in sft.stages}):
        length = stage_row_length(max_length, mesh, config.model)
        # The trainer's own batch layout (StepBatch.pack, mini_batches), made from placeholder pairs.
        token = np.zeros(1, np.int32)
        pairs = StepBatch.pack([token] * sft.batch_size, [token] * sft.batch_size, length, 0)
        (batch,) = pairs.mini_batches(1, "token-mean", 1, micro_batches=sft.micro_batches,
                                      devices=batch_devices(mesh))
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
        programs.append(_train_program(f"sft_step_{max_length}", step, state, batch, model_config,
                                       devices[0].platform, rows=sft.batch_size, length=length,
                                       micro_batches=sft.micro_batches))
    return programs, mesh


def rl_step_programs(config: TrainConfig, model_config: ModelConfig, devices: list) -> tuple[list[Program], Any]:
    """The programs of one RL step of ``config`` on ``devices`` (its mesh's product of them), and the mesh."""
    if config.update.pack:
        raise InputError("update.pack=true: jaxrl compile lowers unpacked rows only (packed rows' shapes depend on "
                         "the samples); compile with update.pack=false, an upper bound on the packed step's memory")
    if config.critic is not None:
        raise InputError("advantage.estimator=gae (a critic): jaxrl compile lowers the policy's programs only")
    mesh, graphdef, params = _abstract_learner(config, model_config, devices)
    shapes = step_shapes(config, mesh)
    length, c = shapes["length"], model_config
    objective, _ = objective_for_run(config, builds_engine=True, has_experts=model_config.num_experts > 0)
    frozen = frozen_policy_steps(config)
    optimizer, _ = build_optimizer(config.optimizer, max(config.steps - frozen, 0) * config.update.mini_batches)
    loss_fn = rl_loss_fn(objective, seed=config.seed, micro_batches=config.update.micro_batches,
                         chunk_size=config.update.logprob_chunk_size)
    step = build_train_step(graphdef, params, optimizer, loss_fn, mesh)
    state = abstract_train_state(step, params)
    reference = config.objective.kl_kind != "none" or config.update.reference_metrics
    batch = abstract_update_batch(shapes["update_rows"], length, reference=reference)
    param_bytes, state_bytes = per_device_bytes(state["params"]), per_device_bytes(state)
    # The reference is a copy of the initial parameters, alive for the whole run.
    held = param_bytes if reference else 0
    platform = devices[0].platform
    n, (_, kernel, experts) = matmul_params(c), _kernels(c, platform, length)
    programs = [_train_program("train_step", step, state, batch, c, platform, rows=shapes["update_rows"],
                               length=length, micro_batches=config.update.micro_batches, resident_bytes=held)]
    scorer = LogprobScorer(graphdef, mesh, shapes["score_rows"], config.update.logprob_chunk_size,
                           devices=batch_devices(mesh))
    score_rows = shapes["score_rows"]
    score_attention = attention_flops(c, score_rows, length)
    score = dict(model_flops=2.0 * n * score_rows * length + score_attention,
                 kernel_flops=(score_attention if kernel else 0.0) + 2.0 * experts * score_rows * length,
                 min_hbm_bytes=param_bytes,
                 resident_bytes=state_bytes - param_bytes + held)
    if not objective.bypass:
        programs.append(Program("old_logprob_scorer", f"old_logp recompute: {score_rows} rows x {length} tokens a call",
                                lambda: scorer.lower(state["params"], score_rows, length), **score))
    if reference:
        programs.append(Program("reference_scorer", "ref_logp: the same scorer program over the reference's copy",
                                lambda: scorer.lower(state["params"], score_rows, length), **score,
                                same_as="" if objective.bypass else "old_logprob_scorer"))
    if config.rollout.engine == "embedded":
        programs += _sampler_programs(config, c, graphdef, state, mesh, shapes, param_bytes,
                                      resident=state_bytes - param_bytes + held)
    return programs, mesh


def _sampler_programs(config, c: ModelConfig, graphdef, state, mesh, shapes, param_bytes: int, *, resident: int):
    """The embedded sampler's prefill + decode program for the step's rollouts, and for the held-out
    evaluation when the config has one (other batch and prompt counts: another program)."""
    r = config.rollout
    sampler = JaxSampler(nnx.merge(graphdef, state["params"]), mesh=mesh, max_batch=shapes["max_batch"])
    calls = [("sampler", r.prompts_per_step, r.group_size)]
    if config.data.eval_files:
        calls.append(("eval_sampler", config.eval.max_prompts, config.eval.samples))
    programs = []
    for name, prompts, samples in calls:
        # The largest call: max_batch of the prompt-major jobs, which may straddle one more prompt.
        sequences = min(prompts * samples, sampler.max_batch)
        distinct = min(prompts, -(-sequences // samples) + (1 if sequences % samples else 0))
        rows, prompt_rows, prompt_bucket, _, _ = sampler._shapes(
            sequences, distinct, config.data.max_prompt_tokens, r.max_new_tokens)
        n, steps = matmul_params(c), r.max_new_tokens
        prefill = 2.0 * n * prompt_rows * prompt_bucket + attention_flops(c, prompt_rows, prompt_bucket)
        # Each decode step attends over the prompt and the tokens so far: ~ (P + steps / 2) keys on average.
        decode = steps * rows * (2.0 * n + 2 * attention_flops(c, 1, 1) * (prompt_bucket + steps / 2))
        programs.append(Program(
            name, f"one call: prefill {prompt_rows} prompts x {prompt_bucket} + decode loop {rows} rows x {steps} "
            "tokens",
            lambda s=sequences, d=distinct: sampler.lower(s, d, config.data.max_prompt_tokens, r.max_new_tokens),
            model_flops=prefill + decode, min_hbm_bytes=float(steps) * param_bytes, resident_bytes=resident,
            kernel_flops=2.0 * grouped_expert_params(c) * (prompt_rows * prompt_bucket + steps * rows)))
    return programs


# XLA:TPU refuses a program whose buffers exceed the chip's HBM: "... required for HLO temporaries (125.68G)
# exceeds available HBM (95.74G)"; the figures (GiB) are what it needed and had.
_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", re.S)


# A Pallas kernel compiled for TPU is an HLO custom call to "tpu_custom_call"; XLA names the instruction
# after the kernel: "%gmm.1 = ... custom-call(...), custom_call_target="tpu_custom_call"".
_KERNEL_CALL = re.compile(r'^\s*(?:ROOT\s+)?%([\w.-]+?)(?:\.\d+)?\s*=.*custom_call_target="tpu_custom_call"', re.M)


def mosaic_kernels(hlo_text: str) -> tuple[str, ...]:
    """The distinct Mosaic (Pallas) kernels a compiled TPU program calls, by the names XLA gives
    their instructions (``gmm``, ``tgmm``, ``splash_mqa_fwd_segmented_no_residuals``, ...), from
    the compiled HLO: the evidence that a kernel survived compilation, not only lowering."""
    return tuple(sorted(set(_KERNEL_CALL.findall(hlo_text))))


# A GPU library call in compiled HLO: custom_call_target="__cudnn$fmhaSoftmaxBackward", "__cublas$gemm", ...
_LIBRARY_CALL = re.compile(r'custom_call_target="(__(?:cudnn|cublas)[^"]*)"')


def kernels_called(hlo_text: str) -> tuple[str, ...]:
    """The kernels a compiled program calls that XLA did not generate: Mosaic kernels on TPU
    (:func:`mosaic_kernels`), cuDNN and cuBLAS calls on NVIDIA GPUs (``__cudnn$fmhaSoftmax``,
    ``__cudnn$fmhaSoftmaxBackward``, ``__cublas$gemm``, ...)."""
    return tuple(sorted(set(mosaic_kernels(hlo_text)) | set(_LIBRARY_CALL.findall(hlo_text))))


def compile_programs(programs: list[Program], on_done: Callable[[Compiled], None] | None = None) -> list[Compiled]:
    """Lower and compile each program (one compile for programs that name ``same_as``). A program XLA
    refuses for want of HBM is a result (``refused``, with the bytes it asked for), not an error."""
    results: dict[str, Compiled] = {}
    for program in programs:
        if program.same_as in results:
            results[program.name] = dataclasses.replace(results[program.same_as], program=program)
        else:
            start = time.perf_counter()
            lowered = program.lower()
            try:
                compiled = lowered.compile()
            except jax.errors.JaxRuntimeError as e:
                match = _OOM.search(str(e))
                if match is None:
                    raise
                needed = int(float(match.group(1)) * 2 ** 30)
                results[program.name] = Compiled(program, 0, 0, 0, needed, 0, 0.0, time.perf_counter() - start,
                                                 refused=" ".join(str(e).split())[:300])
            else:
                memory = compiled.memory_analysis()
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                results[program.name] = Compiled(
                    program, memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.alias_size_in_bytes,
                    memory.temp_size_in_bytes, memory.generated_code_size_in_bytes,
                    float((cost or {}).get("flops", 0.0)), time.perf_counter() - start,
                    kernels=kernels_called(compiled.as_text()))
        if on_done is not None:
            on_done(results[program.name])
    return list(results.values())
