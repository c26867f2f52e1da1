#!/usr/bin/env python3
"""Run one command on every worker of a Cloud TPU VM pod slice, then gather the logs.

    python launch/tpu_pod.py --tpu my-pod --zone us-east5-a --accelerator-type v5p-64 \\
        --sync --setup default -- .venv/bin/python -m jaxrl.cli train configs/qwen3_8b_grpo_tpu_pod.yaml

Steps, each printed before it runs (``--dry-run`` prints them and runs nothing):
1. optionally create the slice: ``--create`` (``gcloud compute tpus tpu-vm create``) or
   ``--queued-resource`` (``gcloud compute tpus queued-resources create``, then wait
   until it is ACTIVE);
2. ``--sync``: copy the committed tree (``git archive HEAD``) to every worker;
3. ``--setup``: run a set-up command on every worker (``default``: the venv from
   requirements.txt plus ``jax[tpu]``);
4. run the command on all workers at once (``gcloud compute tpus tpu-vm ssh
   --worker=all``), each worker's output teed to ``WORKDIR/logs/<hostname>.log``;
5. copy every worker's logs to ``--log-dir/worker-<i>/`` (also after a failure);
6. ``--delete-after``: delete what step 1 created.

JAX finds the coordinator, the process count and each worker's index from the
TPU metadata (``JAXRL_CLUSTER=gcetpu`` makes jaxrl insist on that detection,
so a worker never silently trains alone).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEFAULT_SETUP = 'bash scripts/setup.sh && .venv/bin/pip install -q "jax[tpu]==0.10.2"'
REMOTE_LOGS = "logs"
ARCHIVE = "jaxrl-src.tar.gz"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tpu_workers(accelerator_type: str) -> int:
    """Hosts (workers) in a slice of this accelerator type.

    v2/v3/v4/v5p names count TensorCores, 8 per host; v5litepod/v5e/v6e names
    count chips: up to 8 on one host, 4 per host in multi-host slices.
    """
    generation, _, size = accelerator_type.rpartition("-")
    if size.isdigit():
        count = int(size)
        if generation in ("v2", "v3", "v4", "v5p"):
            return max(1, count // 8)
        if generation in ("v5litepod", "v5e", "v6e"):
            return 1 if count <= 8 else count // 4
    raise SystemExit(
        f"--accelerator-type {accelerator_type!r}: unknown worker count; give --workers N "
        f"(known: v2/v3/v4/v5p-<cores>, v5litepod/v5e/v6e-<chips>)"
    )


# The base TPU VM image of each generation (cloud.google.com/tpu/docs/runtimes).
RUNTIME_VERSIONS = {"v2": "tpu-ubuntu2204-base", "v3": "tpu-ubuntu2204-base", "v4": "tpu-ubuntu2204-base",
                    "v5p": "v2-alpha-tpuv5", "v5litepod": "v2-alpha-tpuv5-lite", "v5e": "v2-alpha-tpuv5-lite",
                    "v6e": "v2-alpha-tpuv6e"}


def runtime_version(accelerator_type: str) -> str:
    generation = accelerator_type.rpartition("-")[0]
    if generation not in RUNTIME_VERSIONS:
        raise SystemExit(f"--accelerator-type {accelerator_type!r}: no default TPU runtime; give --runtime-version")
    return RUNTIME_VERSIONS[generation]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tpu", required=True, help="TPU VM (node) name")
    parser.add_argument("--zone", required=True)
    parser.add_argument("--project", default=None, help="GCP project (default: gcloud's configured one)")
    parser.add_argument("--accelerator-type", default=None, help="e.g. v5litepod-16, v4-32, v6e-64")
    parser.add_argument("--workers", type=int, default=None, help="worker count (default: from the accelerator type)")
    creation = parser.add_mutually_exclusive_group()
    creation.add_argument("--create", action="store_true", help="create the TPU VM first")
    creation.add_argument("--queued-resource", action="store_true",
                          help="request the slice as a queued resource first and wait until ACTIVE")
    parser.add_argument("--runtime-version", default=None,
                        help="TPU software version for --create/--queued-resource (default: the "
                             "generation's base image, e.g. v2-alpha-tpuv5 for v5p)")
    parser.add_argument("--spot", action="store_true", help="spot capacity for --create/--queued-resource")
    parser.add_argument("--delete-after", action="store_true", help="delete the slice created here at the end")
    parser.add_argument("--sync", action="store_true", help="copy the committed tree (git archive HEAD) to workers")
    common.add_common_args(parser, workdir="jaxrl", log_dir="logs/tpu")
    args = parser.parse_args(argv)
    command = common.job_command(args, parser)
    if args.workers is None:
        if args.accelerator_type is None:
            parser.error("give --accelerator-type or --workers (the worker count is needed to gather logs)")
        args.workers = tpu_workers(args.accelerator_type)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if (args.create or args.queued_resource) and args.accelerator_type is None:
        parser.error("--create/--queued-resource need --accelerator-type")
    if args.delete_after and not (args.create or args.queued_resource):
        parser.error("--delete-after deletes only a slice this launcher created: add --create or --queued-resource")
    if (args.create or args.queued_resource) and args.runtime_version is None:
        args.runtime_version = runtime_version(args.accelerator_type)
    if args.setup == "default":
        args.setup = DEFAULT_SETUP
    return args, command


def _where(args) -> list[str]:
    return [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])


def _queued_resource_id(args) -> str:
    return f"{args.tpu}-qr"


def create_commands(args) -> list[list[str]]:
    spot = ["--spot"] if args.spot else []
    if args.queued_resource:
        return [["gcloud", "compute", "tpus", "queued-resources", "create", _queued_resource_id(args),
                 f"--node-id={args.tpu}", *_where(args), f"--accelerator-type={args.accelerator_type}",
                 f"--runtime-version={args.runtime_version}", *spot]]
    if args.create:
        return [["gcloud", "compute", "tpus", "tpu-vm", "create", args.tpu, *_where(args),
                 f"--accelerator-type={args.accelerator_type}", f"--version={args.runtime_version}", *spot]]
    return []


def queued_state_command(args) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "describe", _queued_resource_id(args),
            *_where(args), "--format=value(state.state)"]


def ssh_all(args, remote: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.tpu, *_where(args), "--worker=all",
            f"--command={remote}"]


def sync_commands(args, archive: str) -> list[list[str]]:
    if not args.sync:
        return []
    return [
        ["git", "-C", REPO_ROOT, "archive", "--format=tar.gz", f"--output={archive}", "HEAD"],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", archive, f"{args.tpu}:{ARCHIVE}", *_where(args),
         "--worker=all"],
    ]


def setup_command(args) -> list[list[str]]:
    workdir = common.shell_path(args.workdir)
    unpack = f"mkdir -p {workdir} && tar xzf {ARCHIVE} -C {workdir}" if args.sync else ""
    setup = f"cd {workdir} && {args.setup}" if args.setup else ""
    line = common.shell_line(unpack, setup)
    return [ssh_all(args, common.bash_c(line))] if line else []


def run_command(args, command: list[str]) -> list[str]:
    env = {"JAXRL_CLUSTER": "gcetpu", **common.parse_env(args.env)}
    workdir = common.shell_path(args.workdir)
    line = common.shell_line(
        f"cd {workdir}", common.exports(env), f"mkdir -p {REMOTE_LOGS}",
        f'{shlex.join(command)} 2>&1 | tee {REMOTE_LOGS}/"$(hostname)".log',
    )
    return ssh_all(args, common.bash_c(line))


def gather_commands(args) -> list[list[str]]:
    remote = f"{args.tpu}:{args.workdir}/{REMOTE_LOGS}"
    return [["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", remote,
             os.path.join(args.log_dir, f"worker-{worker}"), *_where(args), f"--worker={worker}"]
            for worker in range(args.workers)]


def delete_commands(args) -> list[list[str]]:
    if not args.delete_after:
        return []
    if args.queued_resource:
        return [["gcloud", "compute", "tpus", "queued-resources", "delete", _queued_resource_id(args), *_where(args),
                 "--force", "--quiet"]]
    return [["gcloud", "compute", "tpus", "tpu-vm", "delete", args.tpu, *_where(args), "--quiet"]]


def wait_until_active(args, dry_run: bool, poll_s: float = 30.0) -> int:
    describe = queued_state_command(args)
    print(f"# until it prints ACTIVE, every {poll_s:g} s: {shlex.join(describe)}", flush=True)
    while not dry_run:
        state = subprocess.run(describe, capture_output=True, text=True).stdout.strip()
        if state == "ACTIVE":
            return 0
        if state in ("FAILED", "SUSPENDED"):
            print(f"launch: queued resource {_queued_resource_id(args)} is {state}", file=sys.stderr)
            return 1
        time.sleep(poll_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    print(f"# TPU pod {args.tpu}: {args.workers} workers", flush=True)
    code = common.run_all(create_commands(args), args.dry_run)
    if code == 0 and args.queued_resource:
        code = wait_until_active(args, args.dry_run)
    if code == 0:
        with tempfile.TemporaryDirectory() as scratch:
            code = common.run_all(sync_commands(args, os.path.join(scratch, ARCHIVE)), args.dry_run)
    if code == 0:
        code = common.run_all(setup_command(args), args.dry_run)
    if code == 0:
        code = common.run_all([run_command(args, command)], args.dry_run)
        if not args.dry_run:
            os.makedirs(args.log_dir, exist_ok=True)
        for gather in gather_commands(args):  # every worker's log, whichever failed
            common.run_all([gather], args.dry_run)
    common.run_all(delete_commands(args), args.dry_run)
    return code


if __name__ == "__main__":
    sys.exit(main())
