"""``jaxrl train CONFIG [key=value ...] [--resume]`` and ``jaxrl sft CONFIG [key=value ...] [--resume]``."""

from __future__ import annotations

import argparse
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
    print(json.dumps({k: v for k, v in summary.items()}, indent=2, default=str))


def train_main(argv: Sequence[str]) -> int:
    """RL training (SPEC section 7) from a config; prints a JSON summary at the end."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parse("train", argv, "RL post-training from a config")
    try:
        config = _load(args)
    except (ConfigError, MeshMismatchError) as e:
        print(f"jaxrl train: config error: {e}", file=sys.stderr)
        return 2
    from jaxrl.trainer.rl import RLTrainer

    return _run(RLTrainer, config, args.resume)


def sft_main(argv: Sequence[str]) -> int:
    """Supervised fine-tuning from a config (the ``sft`` section); prints a JSON summary."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parse("sft", argv, "supervised fine-tuning on prompt/response pairs")
    try:
        config = _load(args)
    except (ConfigError, MeshMismatchError) as e:
        print(f"jaxrl sft: config error: {e}", file=sys.stderr)
        return 2
    from jaxrl.trainer.sft import SFTTrainer

    return _run(SFTTrainer, config, args.resume)
