"""What every launcher shares: ``KEY=VALUE`` environments, the remote shell line, dry runs.

Standard library only, so the launchers run on a laptop that has nothing but
``gcloud``, ``sbatch`` or ``ssh``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from typing import Mapping, Sequence

DEFAULT_PORT = 8476
# --setup names a launcher may expand: gpu sets up an NVIDIA GPU host, runtime only (docs/install.md#nvidia-gpus).
SETUP_PRESETS = {"gpu": "bash scripts/setup_gpu.sh"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``["A=1", "B=x y"]`` -> ``{"A": "1", "B": "x y"}``; a bad item is an error naming it."""
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(name):
            raise SystemExit(f"--env {item!r}: expected NAME=VALUE with NAME a shell variable name")
        env[name] = value
    return env


def add_common_args(parser: argparse.ArgumentParser, *, workdir: str, log_dir: str) -> None:
    """Flags every launcher takes; the command to run comes after ``--``."""
    parser.add_argument("--workdir", default=workdir, help="the jaxrl checkout on the machines (default %(default)s)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for the command on every process (repeatable)")
    parser.add_argument("--setup", default=None, metavar="SHELL", type=lambda value: SETUP_PRESETS.get(value, value),
                        help="shell command run once per machine in --workdir before the job (e.g. installs); gpu: "
                             f"{SETUP_PRESETS['gpu']} (the learner and SGLang for NVIDIA GPUs, no test tools)")
    parser.add_argument("--log-dir", default=log_dir, help="where logs are gathered (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print exactly what would run, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS... run by every process")


def job_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("give the command to run after --, e.g. -- .venv/bin/python -m jaxrl.cli train configs/x.yaml")
    return command


def exports(env: Mapping[str, str]) -> str:
    """``export A=1 B='x y'`` (empty string for no variables)."""
    if not env:
        return ""
    return "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())


def shell_path(path: str) -> str:
    """A path for a remote shell, quoted, with a leading ``~/`` still meaning the home directory."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def shell_line(*parts: str) -> str:
    """Joins non-empty shell fragments with ``&&`` so that the first failure stops the line."""
    return " && ".join(part for part in parts if part)


def bash_c(script: str) -> str:
    """``bash -c '<script>'`` as one string for a remote shell, with pipefail on."""
    return "bash -c " + shlex.quote("set -o pipefail; " + script)


def run_all(commands: Sequence[Sequence[str]], dry_run: bool) -> int:
    """Runs the commands one after the other, stopping at the first failure; prints them when dry."""
    for command in commands:
        print(shlex.join(command), flush=True)
        if not dry_run:
            code = subprocess.call(list(command))
            if code != 0:
                print(f"launch: {shlex.join(command)} exited with {code}", file=sys.stderr)
                return code
    return 0
