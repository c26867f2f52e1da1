"""The run folder under faults: a second run on it, a full disk, a run stuck after SIGTERM, and
``--resume`` with nowhere to resume from. Each through ``jaxrl train``, as a user meets it.

The reward below is referenced as f"{__name__}:name" (``kind: python``), so the reward worker
imports this module: keep its imports light.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from jaxrl.cli import main
from jaxrl.trainer.lifecycle import RunLock


def stuck_reward(prompt, response, response_ids, row):
    """Says it started (a file next to the run's folder), then never returns."""
    open(os.environ["STUCK_MARKER"], "w").close()
    time.sleep(3600)


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _train(config_path: str, *extra: str, timeout: float = 240, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "train", config_path, *extra], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def test_a_second_run_on_the_same_folder_is_refused(tmp_path, run_config, capfd):
    """Before: two runs on one output_dir, started 3 s apart, both exited 0, metrics.jsonl held
    steps 1-10 twice and both wrote the checkpoint folder. Now the run folder's lock is held for
    the run: the second is refused in one line naming the folder and the holder (exit 2)."""
    out = tmp_path / "out"
    config = _write(tmp_path, run_config(out))
    with RunLock(str(out)):
        assert main(["train", config]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"jaxrl train: another run is using {out} (pid {os.getpid()} on ")
    assert err.endswith(f"holding {out}/run.lock); wait for it to end or choose another output_dir")
    assert not (out / "metrics.jsonl").exists()


def test_a_killed_runs_lock_is_not_in_the_way(tmp_path):
    """flock dies with its process: a holder killed with SIGKILL leaves the file, not the lock."""
    hold = ("import sys; from jaxrl.trainer.lifecycle import RunLock; "
            "lock = RunLock(sys.argv[1]); lock.__enter__(); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(ValueError, match=f"pid {holder.pid} on "):
        RunLock(str(tmp_path)).__enter__()
    holder.kill()
    holder.wait()
    with RunLock(str(tmp_path)) as lock:
        assert open(lock.path).read().startswith(f"pid {os.getpid()} on ")


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only): ``fill(kib)`` takes that much of it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("this machine does not allow mounting a tmpfs")

    def fill(kib: int):
        subprocess.run(["dd", "if=/dev/zero", f"of={disk}/fill", "bs=1k", f"count={kib}"], check=True,
                       capture_output=True)
        return disk

    yield fill
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_disk_that_fills_during_the_run_ends_it_naming_output_dir(tmp_path, run_config, small_disk):
    """Before: TensorBoard's writer thread died with ENOSPC and the next metrics line waited on its
    full queue for ever (the run hung, 2 of 3 tries). Now the failed write ends the run at once
    with one line naming output_dir and the file, exit 1, TensorBoard on."""
    disk = small_disk(1900)  # about 100 KiB left: some steps, then full
    out = disk / "out"
    config = _write(tmp_path, run_config(out, steps=500, logging={"tensorboard": True}))
    run = _train(config)
    _, err = run.communicate(timeout=240)
    assert run.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"jaxrl train: cannot write the run's metrics in output_dir={out} ({out}/"), last
    assert last.endswith("No space left on device; free space there or choose another output_dir")
    assert "Traceback" not in err


def test_a_full_disk_at_the_start_is_named(tmp_path, run_config, small_disk, capfd):
    disk = small_disk(2048)
    assert main(["train", _write(tmp_path, run_config(disk / "out"))]) == 2
    err = capfd.readouterr().err.strip()
    assert err == (f"jaxrl train: cannot write in output_dir={disk}/out: No space left on device; choose a folder "
                   f"this user can write, with free space")


def test_a_run_stuck_after_sigterm_ends_after_the_stop_timeout(tmp_path, run_config):
    """Before: SIGTERM only asked the run to stop after its step; a step that never ends (here a
    reward that never returns, its time limit an hour) kept the run forever. Now, past
    ``checkpoint.stop_timeout_s`` after the signal, it exits 143 naming where it was stuck."""
    marker = tmp_path / "stuck"
    config = _write(tmp_path, run_config(
        tmp_path / "out", checkpoint={"directory": str(tmp_path / "ckpt"), "stop_timeout_s": 2},
        reward={"timeout_s": 3600, "tasks": {"t": {"kind": "python", "function": f"{__name__}:stuck_reward"}}}))
    run = _train(config, env={**os.environ, "STUCK_MARKER": str(marker),
                              "PYTHONPATH": os.pathsep.join(sys.path)})
    deadline = time.monotonic() + 180
    while not marker.exists():  # the reward has started: the step cannot end
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    _, err = run.communicate(timeout=60)
    assert run.returncode == 143 and time.monotonic() - signalled < 30, err
    assert "jaxrl: still running 2 s after SIGTERM (checkpoint.stop_timeout_s), stuck at " in err
    stuck_at = err.split("stuck at ")[1].split(";")[0]
    assert f"{os.sep}jaxrl{os.sep}reward{os.sep}" in stuck_at, stuck_at


def test_resume_without_a_checkpoint_folder(tmp_path, run_config, capfd):
    """Before: a ValueError traceback from deep in the trainer, exit 1."""
    assert main(["train", _write(tmp_path, run_config(tmp_path / "out")), "checkpoint.directory=", "--resume"]) == 2
    assert capfd.readouterr().err.strip() == (
        "jaxrl train: --resume needs checkpoint.directory (empty in this config): set it to the folder the run "
        "saved its checkpoints in, e.g. checkpoint.directory=runs/x/checkpoints")


def test_a_checkpoint_disk_that_fills_is_one_line_and_stops_the_run(tmp_path, run_config, small_disk):
    """Before: 377 lines on the terminal (each of Orbax's threads logged its traceback, asyncio its
    unretrieved futures) and the run trained two steps past the failed save. Now the one line
    names the folder, the failed save's step and the cause, and the run stops by the next save."""
    disk = small_disk(1900)  # about 100 KiB left: less than one checkpoint of the tiny model
    config = _write(tmp_path, run_config(tmp_path / "out", steps=8, checkpoint={"directory": str(disk / "ck"),
                                                                                "every": 2}))
    run = _train(config)
    _, err = run.communicate(timeout=240)
    assert run.returncode == 1, err
    assert err.count("\n") == 1, err
    assert err.startswith(f"jaxrl train: writing checkpoint of step 2 to {disk}/ck failed: "), err
    assert "No space left on device" in err and err.endswith("then --resume\n"), err
    steps = [json.loads(line)["step"] for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert steps[-1] in (2, 3, 4), steps


def _as_nobody(command: list[str]) -> list[str]:
    """``command`` as uid/gid 65534 without root's right to write anywhere (it keeps the right to
    read, so the interpreter and the repository stay readable)."""
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search", *command]


@pytest.mark.parametrize("exists", [True, False], ids=["existing folder", "folder to make"])
def test_a_checkpoint_folder_this_user_cannot_write_is_named_at_the_start(run_config, exists):
    """Before (as a user without root): a PermissionError traceback from Orbax making the folder, exit 1."""
    if os.geteuid() != 0 or subprocess.run(_as_nobody(["true"])).returncode != 0:
        pytest.skip("switching to an unprivileged user needs root and setpriv")
    base = tempfile.mkdtemp()  # a folder the user can reach, as their own would be (pytest's are root's only)
    try:
        roots = os.path.join(base, "roots")  # the user's folders sit in root's, which they cannot write
        os.makedirs(os.path.join(roots, "ck"))
        theirs = os.path.join(base, "theirs")
        os.mkdir(theirs)
        os.chown(theirs, 65534, 65534)
        os.chmod(base, 0o755)
        checkpoints = os.path.join(roots, "ck" if exists else "new")
        config = os.path.join(base, "config.json")
        with open(config, "w") as f:
            json.dump(run_config(os.path.join(theirs, "out"), checkpoint={"directory": checkpoints}), f)
        env = {key: value for key, value in os.environ.items() if key != "JAX_COMPILATION_CACHE_DIR"}
        run = subprocess.run(_as_nobody([sys.executable, "-m", "jaxrl.cli", "train", config]), capture_output=True,
                             text=True, timeout=240, env={**env, "HOME": theirs})
        assert run.returncode == 2, run.stderr
        assert run.stderr == (f"jaxrl train: cannot write in checkpoint.directory={checkpoints}: Permission "
                              f"denied; choose a folder this user can write, with free space\n")
        assert os.listdir(roots) == ["ck"] and os.listdir(os.path.join(roots, "ck")) == []
    finally:
        shutil.rmtree(base)
