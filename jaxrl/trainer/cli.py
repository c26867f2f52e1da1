"""``jaxrl train CONFIG [key=value ...] [--resume | --overwrite | --dry-run]`` and the same for ``jaxrl sft``.

Start-up order: the config is loaded and checked first (nothing touches a device), then a
``placement`` section restricts JAX to the learner's devices, then the processes join
(``jaxrl.distributed``) and the mesh is checked against them. ``--dry-run`` stops after the
config: it prints every host's plan (the learner's devices, each SGLang server's command line
and GPUs) and starts nothing.

Exit status: 0 done; 2 a bad config, file, folder or row (one line naming it), an earlier
run in the way or another run holding ``output_dir``; 128 + N stopped by signal N (SIGTERM 143,
SIGINT 130) after saving a checkpoint, or without saving when the step was still running
``checkpoint.stop_timeout_s`` after the signal; 1 a failure during training (non-finite
updates, a failed checkpoint or metrics write, a failed push check, an SGLang server that never
became healthy), with a one-line cause.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Sequence

from jaxrl.config import ConfigError
from jaxrl.distributed import MeshMismatchError
from jaxrl.errors import InputError


def _parse(prog: str, argv: Sequence[str], what: str):
    from jaxrl import distributed

    processes, argv = distributed.parse_args(list(argv))
    parser = argparse.ArgumentParser(
        prog=f"jaxrl {prog}", description=what,
        epilog="Overrides use the config's dotted keys, e.g. optimizer.lr=1e-5 rollout.group_size=16.")
    parser.add_argument("config", help="a YAML or JSON config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="optional key=value overrides")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint")
    start.add_argument("--overwrite", action="store_true",
                       help="delete an earlier run's metrics and checkpoints in output_dir / checkpoint.directory "
                            "and start afresh (without it, a fresh start over an earlier run is refused)")
    start.add_argument("--dry-run", action="store_true",
                       help="print every host's plan (learner devices, SGLang servers with their GPUs and command "
                            "lines) and start nothing")
    if not argv:
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    args = parser.parse_intermixed_args(argv)  # flags anywhere among the overrides
    args.processes = processes
    return args


def _load(args):
    from jaxrl.config import load_config
    from jaxrl.trainer.config import TrainConfig

    return load_config(TrainConfig, args.config, args.overrides)


def _join(config, processes):
    """Restricts JAX to the learner's devices (a placement), joins the processes and checks the mesh;
    returns the config this process runs (the others log into ``output_dir/process-<i>``)."""
    import dataclasses
    import os

    import jax

    from jaxrl import distributed
    from jaxrl.distributed import placement
    from jaxrl.trainer.config import LoggingConfig

    if config.placement is not None:
        ids = placement.restrict_learner_devices(config.placement, config.rollout.sglang.server.device == "cuda")
        if ids is not None and processes.local_device_ids not in (None, ids):
            raise InputError(f"--local-device-ids / {distributed.ENV_LOCAL_DEVICE_IDS}="
                             f"{list(processes.local_device_ids)} contradicts placement.learner_devices={list(ids)}; "
                             "give only the placement")
        processes = dataclasses.replace(processes, local_device_ids=ids or processes.local_device_ids)
    distributed.initialize(processes)
    if config.placement is not None:
        placement.learner_devices(config.placement, jax.process_count(), jax.devices())
    else:
        distributed.check_mesh(dataclasses.asdict(config.mesh))
    if not distributed.is_main_process():
        # Logs, TensorBoard and plots come from process 0; the others keep only their own JSONL.
        own_dir = os.path.join(config.output_dir, f"process-{jax.process_index()}")
        config = dataclasses.replace(config, output_dir=own_dir,
                                     logging=LoggingConfig(tensorboard=False, progress=False, plots=False))
    return config


def _run(prog: str, trainer_class, config, args) -> int:
    """Builds and runs the trainer; with several processes a failure in one stops them all (a
    stop on a signal is no failure: every process stops after the same step and returns)."""
    from jaxrl import distributed
    from jaxrl.trainer.lifecycle import RunLock, TrainingInterrupted

    with distributed.stop_all_on_failure(), RunLock(config.output_dir):
        trainer = trainer_class(config, resume=args.resume, overwrite=args.overwrite)
        try:
            summary = trainer.run()
        except TrainingInterrupted as e:
            print(f"jaxrl {prog}: {e}", file=sys.stderr)
            return e.exit_code
        finally:
            trainer.close()
    if distributed.is_main_process():
        _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    print(json.dumps(summary, indent=2, default=str))


def _main(prog: str, what: str, argv: Sequence[str], trainer_module: str, trainer_name: str) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parse(prog, argv, what)
    try:
        config = _load(args)
        if args.dry_run:
            from jaxrl.trainer.plan import describe_plan

            print(describe_plan(config))
            return 0
        config = _join(config, args.processes)
    except (ConfigError, MeshMismatchError, InputError) as e:
        print(f"jaxrl {prog}: config error: {e}", file=sys.stderr)
        return 2
    # Imported after the config is valid: a config error is reported without loading JAX models.
    trainer_class = getattr(importlib.import_module(trainer_module), trainer_name)
    from jaxrl.reward import JudgeUnavailableError
    from jaxrl.rollout.sglang.server import ServerStartError
    from jaxrl.trainer.checkpoint import CheckpointSaveError
    from jaxrl.trainer.guard import NonFiniteUpdateError
    from jaxrl.trainer.metrics import MetricsWriteError
    from jaxrl.rollout.base import PushVerificationError

    try:
        return _run(prog, trainer_class, config, args)
    except (InputError, FileNotFoundError) as e:  # FileNotFoundError: --resume with no intact checkpoint
        print(f"jaxrl {prog}: {e}", file=sys.stderr)
        return 2
    except (NonFiniteUpdateError, CheckpointSaveError, PushVerificationError, JudgeUnavailableError,
            ServerStartError, MetricsWriteError) as e:
        print(f"jaxrl {prog}: {e}", file=sys.stderr)
        return 1


def train_main(argv: Sequence[str]) -> int:
    """RL training (docs/training.md#the-rl-update-loop) from a config; prints a JSON summary at the end."""
    return _main("train", "RL post-training from a config", argv, "jaxrl.trainer.rl", "RLTrainer")


def sft_main(argv: Sequence[str]) -> int:
    """Supervised fine-tuning from a config (the ``sft`` section); prints a JSON summary."""
    return _main("sft", "supervised fine-tuning on prompt/response pairs", argv, "jaxrl.trainer.sft", "SFTTrainer")
