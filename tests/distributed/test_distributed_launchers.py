"""The launchers in launch/: dry-run output for a few configurations, and real local runs."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import time

import pytest

from jax_processes import REPO

LAUNCH = os.path.join(REPO, "launch")
# Prints the distributed settings a launched process sees, as JSON.
SHOW_ENV = [sys.executable, "-c",
            "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k in ("
            "'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'JAX_LOCAL_DEVICE_IDS', 'EXTRA')"
            " or k.startswith('JAXRL_')}))"]


def launch(script: str, *args: str, cwd=REPO, env=None, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(LAUNCH, script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def commands(stdout: str) -> list[list[str]]:
    """The printed command lines (comments dropped), split as a shell would."""
    return [shlex.split(line) for line in stdout.splitlines() if line and not line.startswith("#")]


@pytest.mark.parametrize("accelerator, workers", [
    ("v5litepod-16", 4), ("v4-32", 4), ("v6e-8", 1), ("v5p-128", 16), ("v3-8", 1)])
def test_tpu_pod_dry_run_runs_the_command_on_all_workers_and_gathers_every_log(accelerator, workers):
    out = launch("tpu_pod.py", "--tpu", "pod", "--zone", "us-east5-b", "--project", "proj",
                 "--accelerator-type", accelerator, "--env", "EXTRA=a b", "--dry-run",
                 "--", ".venv/bin/python", "-m", "jaxrl.cli", "train", "configs/tpu.yaml", "steps=2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"# TPU pod pod: {workers} workers"
    run, *gathers = commands(out.stdout)
    assert run[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod"]
    assert {"--zone=us-east5-b", "--project=proj", "--worker=all"} <= set(run)
    remote = next(arg for arg in run if arg.startswith("--command="))[len("--command="):]
    bash, dash_c, script = shlex.split(remote)
    assert (bash, dash_c) == ("bash", "-c")
    assert script == ("set -o pipefail; cd jaxrl && export JAXRL_CLUSTER=gcetpu EXTRA='a b' && mkdir -p logs && "
                      ".venv/bin/python -m jaxrl.cli train configs/tpu.yaml steps=2 2>&1 | "
                      'tee logs/"$(hostname)".log')
    assert [g[g.index("scp"):g.index("scp") + 4] for g in gathers] == [
        ["scp", "--recurse", "pod:jaxrl/logs", f"logs/tpu/worker-{w}"] for w in range(workers)]
    assert [g[-1] for g in gathers] == [f"--worker={w}" for w in range(workers)]


def test_tpu_pod_queued_resource_dry_run_requests_waits_syncs_sets_up_and_deletes():
    out = launch("tpu_pod.py", "--tpu", "pod", "--zone", "z", "--accelerator-type", "v4-16", "--queued-resource",
                 "--spot", "--sync", "--setup", "default", "--delete-after", "--dry-run", "--", "jaxrl", "train", "c")
    assert out.returncode == 0, out.stderr
    lines = commands(out.stdout)
    assert lines[0] == ["gcloud", "compute", "tpus", "queued-resources", "create", "pod-qr", "--node-id=pod",
                        "--zone=z", "--accelerator-type=v4-16", "--runtime-version=tpu-ubuntu2204-base", "--spot"]
    assert "until it prints ACTIVE" in out.stdout and "queued-resources describe pod-qr" in out.stdout
    assert lines[1][:4] == ["git", "-C", REPO, "archive"]
    assert lines[2][:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in lines[2]
    setup = lines[3][-1]
    assert "tar xzf jaxrl-src.tar.gz -C jaxrl && cd jaxrl && bash scripts/setup.sh" in setup
    assert "jax[tpu]==0.10.2" in setup
    assert "jaxrl train c" in lines[4][-1]
    assert len(lines) == 5 + 2 + 1  # run, two workers' logs, delete
    assert lines[-1] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "pod-qr", "--zone=z",
                         "--force", "--quiet"]


def test_tpu_pod_unknown_accelerator_asks_for_the_worker_count():
    out = launch("tpu_pod.py", "--tpu", "p", "--zone", "z", "--accelerator-type", "v9x-64", "--dry-run", "--", "x")
    assert out.returncode != 0
    assert "'v9x-64': unknown worker count; give --workers N" in out.stderr


@pytest.mark.parametrize("tasks, per_node, local_ids", [("per-node", 1, False), ("per-gpu", 4, True)])
def test_slurm_script_runs_one_task_per_node_or_gpu_with_the_first_node_as_coordinator(
        tmp_path, tasks, per_node, local_ids):
    logs = tmp_path / "logs"
    out = launch("slurm.py", "--nodes", "2", "--gpus-per-node", "4", "--tasks", tasks, "--partition", "gpu",
                 "--time", "1:00:00", "--env", "EXTRA=1", "--log-dir", str(logs), "--workdir", str(tmp_path),
                 "--dry-run", "--", *SHOW_ENV)
    assert out.returncode == 0, out.stderr
    processes = 2 * per_node
    assert out.stdout.splitlines()[0].startswith(f"# SLURM job jaxrl: 2 nodes, {processes} processes")
    script = out.stdout.split(":\n", 1)[1].rsplit("sbatch ", 1)[0]
    for directive in ("--nodes=2", f"--ntasks-per-node={per_node}", "--gpus-per-node=4", "--partition=gpu",
                      "--time=1:00:00", f"--output={logs}/%x-%j.out"):
        assert f"#SBATCH {directive}\n" in script
    assert out.stdout.splitlines()[-1] == f"sbatch {logs}/jaxrl.sbatch"
    assert not logs.exists()  # a dry run writes nothing

    # Run the script as SLURM would, with stand-ins for scontrol and srun.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2 $3" = "show hostnames node-[a-b]" ] '
                                      '&& printf "node-a\\nnode-b\\n"\n')
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable, per_node=per_node))
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(stat.S_IRWXU)
    logs.mkdir()
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "12345",
           "SLURM_JOB_NAME": "jaxrl", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_NUM_NODES": "2"}
    ran = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    seen = [json.loads((logs / f"jaxrl-12345-{task}.out").read_text()) for task in range(processes)]
    for task, settings in enumerate(seen):
        expected = {"JAX_COORDINATOR_ADDRESS": f"node-a:{12345 % 4096 + 61440}",
                    "JAX_NUM_PROCESSES": str(processes), "JAX_PROCESS_ID": str(task), "EXTRA": "1"}
        if local_ids:
            expected["JAX_LOCAL_DEVICE_IDS"] = str(task % per_node)
        assert settings == expected


# srun stand-in: one task per (node, local rank), SLURM_PROCID/SLURM_LOCALID set,
# output to --output with %x/%j/%t filled in; fails if any task fails.
FAKE_SRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
output = next(a.split("=", 1)[1] for a in args if a.startswith("--output="))
command = args[args.index("bash"):]
codes = []
for node in range(int(os.environ["SLURM_JOB_NUM_NODES"])):
    for local in range({per_node}):
        task = node * {per_node} + local
        path = output.replace("%x", os.environ["SLURM_JOB_NAME"]).replace("%j", os.environ["SLURM_JOB_ID"])
        with open(path.replace("%t", str(task)), "w") as out:
            env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(local))
            codes.append(subprocess.call(command, env=env, stdout=out))
sys.exit(max(codes))
"""


def test_multinode_dry_run_places_processes_host_by_host(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2  # the coordinator's host\n\nnode-b\n")
    out = launch("multinode.py", "--hostfile", str(hostfile), "--procs-per-host", "3", "--device-per-process",
                 "--port", "9000", "--workdir", "/srv/jaxrl", "--env", "EXTRA=1", "--dry-run",
                 "--", "jaxrl", "train", "c.yaml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "# 5 processes on 2 hosts; coordinator node-a:9000"
    lines = commands(out.stdout)
    assert [line[:4] for line in lines] == [["ssh", "-o", "BatchMode=yes", host]
                                            for host in ["node-a"] * 2 + ["node-b"] * 3]
    for process_id, (line, local) in enumerate(zip(lines, [0, 1, 0, 1, 2], strict=True)):
        assert line[4] == shlex.join(["bash", "-c", (
            "set -o pipefail; cd /srv/jaxrl && export EXTRA=1 JAX_COORDINATOR_ADDRESS=node-a:9000 "
            f"JAX_NUM_PROCESSES=5 JAX_PROCESS_ID={process_id} JAX_LOCAL_DEVICE_IDS={local} "
            "&& exec jaxrl train c.yaml")])
    assert not (tmp_path / "logs").exists()


def test_multinode_bad_hostfile_line_names_file_and_line(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a\nnode-b slots=two\n")
    out = launch("multinode.py", "--hostfile", str(hostfile), "--dry-run", "--", "x")
    assert out.returncode != 0 and f"{hostfile}:2: expected 'HOST' or 'HOST slots=N'" in out.stderr


def test_multinode_runs_locally_gathers_logs_and_a_failure_stops_the_others(tmp_path):
    logs = tmp_path / "logs"
    out = launch("multinode.py", "--hosts", "localhost", "--procs-per-host", "2", "--env", "EXTRA=x",
                 "--log-dir", str(logs), "--", *SHOW_ENV, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    inherited = {k: v for k, v in os.environ.items() if k.startswith("JAXRL_")}  # e.g. JAXRL_TEST_WORKERS
    for process_id in range(2):
        settings = json.loads((logs / f"process-{process_id}.log").read_text())
        assert settings == {**inherited, "EXTRA": "x", "JAX_COORDINATOR_ADDRESS": "localhost:8476",
                            "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(process_id)}

    # Process 1 fails at once; process 0 would sleep a minute unless stopped.
    marker = f"launcher-test-{os.getpid()}-{time.time_ns()}"
    fail_or_sleep = (f"import os, sys, time; sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(60)"
                     f"  # {marker}")
    start = time.monotonic()
    out = launch("multinode.py", "--hosts", "127.0.0.1", "--procs-per-host", "2", "--log-dir", str(logs),
                 "--", sys.executable, "-c", fail_or_sleep, cwd=tmp_path)
    assert out.returncode == 3
    assert time.monotonic() - start < 20
    assert f"process 1 exited with 3; stopping the others (log: {logs}/process-1.log)" in out.stderr
    leftover = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert leftover.stdout == ""


def test_gpu_setup_preset_sets_up_every_host_with_the_runtime_only(tmp_path):
    """--setup gpu: scripts/setup_gpu.sh on every host before the job (multinode: one line per host;
    SLURM: in the batch script, in the workdir all nodes share)."""
    out = launch("multinode.py", "--hosts", "node-a,node-b", "--workdir", "/srv/jaxrl", "--setup", "gpu",
                 "--dry-run", "--", "jaxrl", "train", "c.yaml")
    assert out.returncode == 0, out.stderr
    setups = [line for line in commands(out.stdout) if "setup_gpu.sh" in " ".join(line)]
    assert [line[3] for line in setups] == ["node-a", "node-b"]
    assert all(line[4] == shlex.join(["bash", "-c", "set -o pipefail; cd /srv/jaxrl && bash scripts/setup_gpu.sh"])
               for line in setups)
    out = launch("slurm.py", "--nodes", "2", "--gpus-per-node", "8", "--setup", "gpu", "--log-dir", str(tmp_path),
                 "--dry-run", "--", "jaxrl", "train", "c.yaml")
    assert out.returncode == 0 and "\nbash scripts/setup_gpu.sh\n" in out.stdout, out.stderr
