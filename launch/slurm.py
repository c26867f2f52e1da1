#!/usr/bin/env python3
"""Write and submit a SLURM batch script that runs one command as one JAX program over nodes.

    python launch/slurm.py --nodes 4 --gpus-per-node 8 --tasks per-node --partition gpu \\
        --time 12:00:00 -- .venv/bin/python -m jaxrl.cli train configs/qwen3_30b_a3b_gspo_gpu.yaml

``--tasks per-node``: one process per node owning all its GPUs (JAX's usual
GPU layout). ``--tasks per-gpu``: one process per GPU, restricted to it with
``JAX_LOCAL_DEVICE_IDS=$SLURM_LOCALID``. Process 0, which runs the
coordinator, is the first task on the first node of the allocation; the port
defaults to one derived from the job id (as JAX's own SLURM detection does),
so two jobs sharing a node do not collide. ``srun --kill-on-bad-exit`` stops
every task when one fails. The working directory must be on a filesystem all
nodes share; logs go to ``--log-dir``: the batch log and one file per task.

``--dry-run`` prints the batch script and the ``sbatch`` line and submits nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# JAX's SLURM detection uses this port range (jax/_src/clusters/slurm_cluster.py).
AUTO_PORT = "$((SLURM_JOB_ID % 4096 + 61440))"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs requested per node (0: none, CPU)")
    parser.add_argument("--tasks", choices=("per-node", "per-gpu"), default="per-node",
                        help="one process per node (default) or per GPU")
    parser.add_argument("--cpus-per-task", type=int, default=None)
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--time", default=None, help="wall-time limit, e.g. 12:00:00")
    parser.add_argument("--job-name", default="jaxrl")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: from the job id)")
    parser.add_argument("--script", default=None, help="where to write the batch script (default: in --log-dir)")
    common.add_common_args(parser, workdir=os.getcwd(), log_dir=os.path.join(os.getcwd(), "logs", "slurm"))
    args = parser.parse_args(argv)
    command = common.job_command(args, parser)
    if args.nodes < 1:
        parser.error(f"--nodes must be >= 1, got {args.nodes}")
    if args.tasks == "per-gpu" and args.gpus_per_node < 1:
        parser.error("--tasks per-gpu needs --gpus-per-node >= 1")
    args.log_dir = os.path.abspath(args.log_dir)
    return args, command


def tasks_per_node(args) -> int:
    return args.gpus_per_node if args.tasks == "per-gpu" else 1


def batch_script(args, command: list[str]) -> str:
    """The sbatch script text."""
    directives = {
        "job-name": args.job_name,
        "nodes": args.nodes,
        "ntasks-per-node": tasks_per_node(args),
        "gpus-per-node": args.gpus_per_node or None,
        "cpus-per-task": args.cpus_per_task,
        "partition": args.partition,
        "account": args.account,
        "time": args.time,
        "output": os.path.join(args.log_dir, "%x-%j.out"),
    }
    per_task = {"JAX_PROCESS_ID": "$SLURM_PROCID"}
    if args.tasks == "per-gpu":
        per_task["JAX_LOCAL_DEVICE_IDS"] = "$SLURM_LOCALID"
    task_line = common.shell_line(
        "export " + " ".join(f'{name}="{value}"' for name, value in per_task.items()),
        "exec " + shlex.join(command),
    )
    port = AUTO_PORT if args.port is None else str(args.port)
    lines = ["#!/usr/bin/env bash"]
    lines += [f"#SBATCH --{name}={value}" for name, value in directives.items() if value is not None]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(args.workdir)}",
        common.exports(common.parse_env(args.env)),
        args.setup or "",
        "# Process 0 (the coordinator) is the first task, on the first node of the allocation.",
        # sed reads all the names: head would exit early and, under pipefail, fail the script on SIGPIPE.
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f'export JAX_COORDINATOR_ADDRESS="$head_node:{port}"',
        f'export JAX_NUM_PROCESSES="$((SLURM_JOB_NUM_NODES * {tasks_per_node(args)}))"',
        "srun --kill-on-bad-exit=1 "
        f"--output={shlex.quote(os.path.join(args.log_dir, '%x-%j-%t.out'))} bash -c {shlex.quote(task_line)}",
    ]
    return "\n".join(line for line in lines if line) + "\n"


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    script = batch_script(args, command)
    path = args.script or os.path.join(args.log_dir, f"{args.job_name}.sbatch")
    processes = args.nodes * tasks_per_node(args)
    print(f"# SLURM job {args.job_name}: {args.nodes} nodes, {processes} processes; script {path}:")
    print(script, end="")
    submit = ["sbatch", path]
    print(shlex.join(submit), flush=True)
    if args.dry_run:
        return 0
    os.makedirs(args.log_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write(script)
    return subprocess.call(submit)


if __name__ == "__main__":
    sys.exit(main())
