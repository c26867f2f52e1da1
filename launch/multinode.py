#!/usr/bin/env python3
"""Start one JAX program over several machines by ssh, for clusters without SLURM.

    python launch/multinode.py --hostfile hosts.txt --procs-per-host 1 \\
        -- .venv/bin/python -m jaxrl.cli train configs/qwen3_8b_grpo_gpu.yaml

Hosts come from ``--hosts a,b`` or ``--hostfile`` (one host per line,
optionally ``host slots=N`` for N processes there; ``#`` starts a comment).
Process ids are given host by host, so process 0, which runs the coordinator,
is the first process on the first host; the coordinator address is
``<first host>:--port`` unless ``--coordinator`` names another address of
that host (e.g. its cluster-network IP). Every process gets
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (and,
with ``--device-per-process``, ``JAX_LOCAL_DEVICE_IDS=<local rank>``) plus
``--env`` settings, runs in ``--workdir`` (the same path on every host), and
writes its output to ``--log-dir/process-<id>.log`` here. When one process
fails the launcher stops the others it started and exits with that
process's status; jaxrl's own failure propagation stops the remote side.
Hosts named ``localhost`` or ``127.0.0.1`` run without ssh.

``--dry-run`` prints each process's command line and log file and starts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LOCAL_HOSTS = ("localhost", "127.0.0.1")
# Seconds a stopped process gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class Process:
    process_id: int
    host: str
    local_rank: int
    argv: tuple[str, ...]
    log: str


def read_hostfile(path: str) -> list[tuple[str, int | None]]:
    """``[(host, slots or None)]`` from a hostfile; a bad line is an error naming the file and line."""
    hosts = []
    with open(path) as f:
        for number, raw in enumerate(f, start=1):
            fields = raw.split("#", 1)[0].split()
            if not fields:
                continue
            slots = None
            for field in fields[1:]:
                key, _, value = field.partition("=")
                if key != "slots" or not value.isdigit() or int(value) < 1:
                    raise SystemExit(f"{path}:{number}: expected 'HOST' or 'HOST slots=N' (N >= 1), "
                                     f"got {raw.strip()!r}")
                slots = int(value)
            hosts.append((fields[0], slots))
    if not hosts:
        raise SystemExit(f"{path}: no hosts (one host per line, optionally 'slots=N')")
    return hosts


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hosts", help="comma-separated host names")
    source.add_argument("--hostfile", help="file with one host per line, optionally 'HOST slots=N'")
    parser.add_argument("--procs-per-host", type=int, default=1, help="processes per host without slots=")
    parser.add_argument("--device-per-process", action="store_true",
                        help="restrict each process to one accelerator: JAX_LOCAL_DEVICE_IDS=<local rank>")
    parser.add_argument("--port", type=int, default=common.DEFAULT_PORT, help="coordinator port (default %(default)s)")
    parser.add_argument("--coordinator", default=None, help="coordinator host (default: the first host)")
    parser.add_argument("--ssh", default="ssh -o BatchMode=yes", help="ssh command (default %(default)r)")
    common.add_common_args(parser, workdir=os.getcwd(), log_dir=os.path.join("logs", "multinode"))
    args = parser.parse_args(argv)
    command = common.job_command(args, parser)
    if args.procs_per_host < 1:
        parser.error(f"--procs-per-host must be >= 1, got {args.procs_per_host}")
    if args.hostfile:
        args.host_slots = [(host, slots or args.procs_per_host) for host, slots in read_hostfile(args.hostfile)]
    else:
        names = [host for host in args.hosts.split(",") if host]
        if not names:
            parser.error("--hosts is empty")
        args.host_slots = [(host, args.procs_per_host) for host in names]
    return args, command


def plan(args, command: list[str]) -> list[Process]:
    """One Process per (host, slot), ids host by host."""
    total = sum(slots for _, slots in args.host_slots)
    coordinator = f"{args.coordinator or args.host_slots[0][0]}:{args.port}"
    user_env = common.parse_env(args.env)
    processes = []
    for host, slots in args.host_slots:
        for local_rank in range(slots):
            process_id = len(processes)
            env = {
                **user_env,
                "JAX_COORDINATOR_ADDRESS": coordinator,
                "JAX_NUM_PROCESSES": str(total),
                "JAX_PROCESS_ID": str(process_id),
            }
            if args.device_per_process:
                env["JAX_LOCAL_DEVICE_IDS"] = str(local_rank)
            line = common.shell_line(
                f"cd {common.shell_path(args.workdir)}", common.exports(env), "exec " + shlex.join(command)
            )
            if host in LOCAL_HOSTS:
                argv = ("bash", "-c", line)
            else:
                argv = (*shlex.split(args.ssh), host, common.bash_c(line))
            log = os.path.join(args.log_dir, f"process-{process_id}.log")
            processes.append(Process(process_id, host, local_rank, argv, log))
    return processes


def setup_commands(args) -> list[list[str]]:
    if not args.setup:
        return []
    line = common.shell_line(f"cd {common.shell_path(args.workdir)}", args.setup)
    return [["bash", "-c", line] if host in LOCAL_HOSTS else [*shlex.split(args.ssh), host, common.bash_c(line)]
            for host, _ in args.host_slots]


def stop(running: dict[int, subprocess.Popen]) -> None:
    for proc in running.values():
        proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in running.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(processes: list[Process]) -> int:
    """Starts all, waits; the first failure stops the rest. Returns the first non-zero status or 0."""
    running: dict[int, subprocess.Popen] = {}
    logs = []
    try:
        for process in processes:
            log = open(process.log, "wb")
            logs.append(log)
            running[process.process_id] = subprocess.Popen(
                process.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        while running:
            for process_id, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[process_id]
                if code != 0:
                    print(f"launch: process {process_id} exited with {code}; stopping the others "
                          f"(log: {processes[process_id].log})", file=sys.stderr)
                    return code
            time.sleep(0.1)
        return 0
    finally:
        stop(running)
        for log in logs:
            log.close()


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    processes = plan(args, command)
    print(f"# {len(processes)} processes on {len(args.host_slots)} hosts; coordinator "
          f"{processes[0].host if args.coordinator is None else args.coordinator}:{args.port}", flush=True)
    code = common.run_all(setup_commands(args), args.dry_run)
    if code != 0:
        return code
    for process in processes:
        print(f"# process {process.process_id} on {process.host} -> {process.log}")
        print(shlex.join(process.argv), flush=True)
    if args.dry_run:
        return 0
    os.makedirs(args.log_dir, exist_ok=True)
    # A terminated launcher stops its processes too (run's finally block).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return run(processes)


if __name__ == "__main__":
    sys.exit(main())
