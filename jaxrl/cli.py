"""The ``jaxrl`` command line: ``jaxrl COMMAND [args...]``."""

from __future__ import annotations

import importlib
import sys

from jaxrl import __version__
from jaxrl.errors import MissingExtraError, needs_extra

# Each command lives in its own module with a ``main(argv) -> int``; importing
# lazily keeps ``jaxrl --help`` fast and free of JAX start-up.
COMMANDS = {
    "demo": ("jaxrl.demo", "main", "the main job: RL on a small model on this CPU"),
    "experiment": ("jaxrl.experiments.registry", "main", "the papers' findings: jaxrl experiment NAME [--quick]"),
    "train": ("jaxrl.trainer.cli", "train_main", "RL training from a config: jaxrl train CONFIG [key=value ...]"),
    "sft": ("jaxrl.trainer.cli", "sft_main", "supervised fine-tuning from a config"),
    "align": ("jaxrl.align.cli", "main", "logprob-alignment checker: engine vs learner"),
    "eval": ("jaxrl.trainer.evaluate", "eval_main", "score a model: avg@n and pass@k per task: jaxrl eval CONFIG"),
    "filter": ("jaxrl.trainer.evaluate", "filter_main", "keep prompts by pass rate: jaxrl filter CONFIG"),
    "compile": ("jaxrl.compile.cli", "main", "compile a config's programs for TPUs or GPUs (none needed)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxrl COMMAND [args...]\n\ncommands:")
        for name, (_, _, doc) in COMMANDS.items():
            print(f"  {name:10s} {doc}")
        print("\n  --version  print the version")
        return 0
    if argv[0] == "--version":
        print(f"jaxrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxrl: unknown command {name!r}; choose one of {sorted(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[name]
    try:
        # Around the run too, not only the import: some commands import their heavy modules inside.
        with needs_extra(f"jaxrl {name}"):
            command = getattr(importlib.import_module(module_name), function_name)
            return int(command(rest) or 0)
    except MissingExtraError as error:
        # Every command needs the [train] extra; the base install is the losses library only.
        print(MissingExtraError(f"jaxrl {name}", error.name, error.extra), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
