"""``jaxrl train CONFIG [key=value ...] [--resume]`` and ``jaxrl sft CONFIG [key=value ...] [--resume]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from jaxrl.config import ConfigError


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
    from jaxrl.config import load_config
    from jaxrl.trainer.config import TrainConfig

    return load_config(TrainConfig, args.config, args.overrides)


def _print_summary(summary: dict) -> None:
    print(json.dumps({k: v for k, v in summary.items()}, indent=2, default=str))


def train_main(argv: Sequence[str]) -> int:
    """RL training (SPEC section 7) from a config; prints a JSON summary at the end."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parse("train", argv, "RL post-training from a config")
    try:
        config = _load(args)
    except ConfigError as e:
        print(f"jaxrl train: config error: {e}", file=sys.stderr)
        return 2
    from jaxrl.trainer.rl import RLTrainer

    trainer = RLTrainer(config, resume=args.resume)
    try:
        _print_summary(trainer.run())
    finally:
        trainer.close()
    return 0


def sft_main(argv: Sequence[str]) -> int:
    """Supervised fine-tuning from a config (the ``sft`` section); prints a JSON summary."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parse("sft", argv, "supervised fine-tuning on prompt/response pairs")
    try:
        config = _load(args)
    except ConfigError as e:
        print(f"jaxrl sft: config error: {e}", file=sys.stderr)
        return 2
    from jaxrl.trainer.sft import SFTTrainer

    trainer = SFTTrainer(config, resume=args.resume)
    try:
        _print_summary(trainer.run())
    finally:
        trainer.close()
    return 0
