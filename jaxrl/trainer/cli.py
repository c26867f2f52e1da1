"""``jaxrl train CONFIG [key=value ...] [--resume]`` and ``jaxrl sft CONFIG [key=value ...] [--resume]``."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Sequence

from jaxrl.config import ConfigError
from jaxrl.distributed import MeshMismatchError


def _parse(prog: str, argv: Sequence[str], what: str):
    from jaxrl import distributed

    _, argv = distributed.initialize_from_argv(list(argv))
    parser = argparse.ArgumentParser(
        prog=f"jaxrl {prog}", description=what,
        epilog="Overrides use the config's dotted keys, e.g. optimizer.lr=1e-5 rollout.group_size=16.")
    parser.add_argument("config", help="a YAML or JSON config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    return parser.parse_args(argv)


def _load(args):
    import dataclasses
    import os

    import jax

    from jaxrl import distributed
    from jaxrl.config import load_config
    from jaxrl.trainer.config import LoggingConfig, TrainConfig

    config = load_config(TrainConfig, args.config, args.overrides)
    distributed.check_mesh(dataclasses.asdict(config.mesh))
    if not distributed.is_main_process():
        # Logs, TensorBoard and plots come from process 0; the others keep only their own JSONL.
        own_dir = os.path.join(config.output_dir, f"process-{jax.process_index()}")
        config = dataclasses.replace(config, output_dir=own_dir,
                                     logging=LoggingConfig(tensorboard=False, progress=False, plots=False))
    return config


def _run(trainer_class, config, resume: bool) -> int:
    """Builds and runs the trainer; with several processes a failure in one stops them all."""
    from jaxrl import distributed

    with distributed.stop_all_on_failure():
        trainer = trainer_class(config, resume=resume)
        try:
            summary = trainer.run()
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
    except (ConfigError, MeshMismatchError) as e:
        print(f"jaxrl {prog}: config error: {e}", file=sys.stderr)
        return 2
    # Imported after the config is valid: a config error is reported without loading JAX models.
    trainer_class = getattr(importlib.import_module(trainer_module), trainer_name)
    return _run(trainer_class, config, args.resume)


def train_main(argv: Sequence[str]) -> int:
    """RL training (SPEC section 7) from a config; prints a JSON summary at the end."""
    return _main("train", "RL post-training from a config", argv, "jaxrl.trainer.rl", "RLTrainer")


def sft_main(argv: Sequence[str]) -> int:
    """Supervised fine-tuning from a config (the ``sft`` section); prints a JSON summary."""
    return _main("sft", "supervised fine-tuning on prompt/response pairs", argv, "jaxrl.trainer.sft", "SFTTrainer")
