"""``jaxrl compile CONFIG --topology NAME [key=value ...]``: compile one RL step's programs for a TPU or GPU topology,
or, for a config with ``sft.stages`` (what ``jaxrl sft`` runs), the train step of each stage's length.

Run TPU topologies with .venv-tpu's interpreter (``bash scripts/setup_tpu_aot.sh``; docs/tpu.md), NVIDIA
GPU ones (``h100:2x8``: CHIP:HOSTSxGPUS) with .venv-cuda-aot's (``bash scripts/setup_cuda_aot.sh``;
docs/gpu-aot.md). Exit status: 0 every program fits the device's memory; 1 one does not (a line per program
naming the bytes, the memory and the config keys that would help); 2 bad input (config, topology, model
shapes) or no compiler for the topology.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process runs on CPU; the programs are for the topology's TPUs
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU VM metadata server to ask for worker hostnames
# libtpu locks /tmp/libtpu_lockfile to keep a TPU to one process; nothing runs on a TPU here, so several
# compiles (a test beside a bench) may share the machine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxrl compile", description="Compile one RL step's programs (an SFT config's: each stage's train "
        "step) ahead of time for a TPU or NVIDIA GPU topology (no TPU or GPU needed) and report per-device memory, "
        "FLOPs and a roofline.",
        epilog="Overrides use the config's dotted keys, e.g. mesh.data=2 update.micro_batches=16.")
    parser.add_argument("config", help="a YAML or JSON RL config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="optional key=value overrides")
    parser.add_argument("--topology", required=True,
                        help="a TPU topology as JAX names it (v5p:4x4x2, v5e:2x2, ...) or GPUs as CHIP:HOSTSxGPUS "
                        "(h100:2x8; chips a100, h100, h200, b200); with a placement, the cluster it lays out")
    parser.add_argument("--slices", type=int, default=1, help="slices of that topology (multi-slice over DCN)")
    parser.add_argument("--model-config", default="",
                        help="a preset (qwen3-8b, qwen3-30b-a3b) or a config.json; default: model.hf_path's "
                             "config.json, else the preset named after its last folder")
    parser.add_argument("--only", default="", help="compile only these programs (comma-separated names: "
                        "train_step, old_logprob_scorer, reference_scorer, sampler, eval_sampler; "
                        "sft_step_LENGTH for an SFT config's stages)")
    parser.add_argument("--json", default="", help="also write the report here")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    from jaxrl.compile import gpus
    from jaxrl.errors import InputError

    try:  # a malformed GPU topology is named before the ~3 s of importing JAX and the trainer
        gpus.parse_topology(args.topology)
    except InputError as e:
        print(f"jaxrl compile: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    from jaxrl.compile import aot, report
    from jaxrl.compile.presets import hf_config_for
    from jaxrl.config import ConfigError, load_config
    from jaxrl.models import ModelConfig
    from jaxrl.trainer.config import TrainConfig

    logging.getLogger("jax").setLevel(logging.ERROR)
    try:
        config = load_config(TrainConfig, args.config, args.overrides)
        policy = config.model
        if policy.architecture is not None and not args.model_config:
            model_config, source = policy.architecture.replace(**policy.overrides()), "model.architecture"
        else:
            hf_config, source = hf_config_for(policy.hf_path, args.model_config)
            model_config = ModelConfig.from_hf(hf_config, **policy.overrides())
        devices = aot.topology_devices(args.topology, args.slices, config.placement)
        fraction = config.placement.learner_memory_fraction if config.placement is not None else None
        if fraction is None and os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
            fraction = float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
        target = report.target_for(args.topology, devices, fraction)
        # A config with SFT stages is what `jaxrl sft` runs: its stages' train steps are the programs.
        step_programs = aot.sft_stage_programs if config.sft.stages else aot.rl_step_programs
        programs, mesh = step_programs(config, model_config, devices)
        if args.only:
            wanted = set(args.only.split(","))
            if wanted - {p.name for p in programs}:
                raise InputError(f"--only {args.only!r}: this config's programs are {[p.name for p in programs]}")
            programs = [p for p in programs if p.name in wanted]
    except (ConfigError, InputError, ValueError, OSError) as e:
        print(f"jaxrl compile: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"{args.config} on {args.topology}{f' x {args.slices} slices' if args.slices > 1 else ''}: "
          f"{target.devices} x {devices[0].device_kind}, mesh {dict(mesh.shape)}; model from {source}", flush=True)
    print(f"memory per device {target.hbm_bytes / report.GIB:.2f} GiB: {target.hbm_source}", flush=True)
    start = time.perf_counter()
    # A line as each program is done: a large model's programs take minutes each to compile.
    results = aot.compile_programs(programs, on_done=lambda r: print(
        f"  {'refused' if r.refused else 'compiled'} {r.program.name} in {r.compile_seconds:.1f} s: "
        f"{r.total_bytes / report.GIB:.2f} GiB per device; {r.program.what}", flush=True))
    print(report.table(results, target))
    for note in report.NOTES:
        print(f"  {note}")
    refused = report.refusals(results, target)
    for line in refused:
        print(f"jaxrl compile: does not fit: {line}", file=sys.stderr)
    if args.json:
        report.write_json(args.json, report.as_json(args.config, source, target, results,
                                                    dataclasses.asdict(config.mesh)))
    worst = min(target.hbm_bytes - r.total_bytes for r in results)
    print(f"{'fits' if not refused else 'does not fit'}: smallest headroom {worst / report.GIB:.2f} GiB per device; "
          f"{len(results)} programs compiled in {time.perf_counter() - start:.1f} s")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
