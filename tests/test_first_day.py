"""The README's two commands in order, as a new user runs them on a fresh clone: the demo first,
then the tests. The demo leaves its run under ``runs/demo`` (checkpoints included); a test that ran
``configs/demo.yaml`` with the config's own ``checkpoint.directory`` once met that run
(``RunExistsError``) and failed. Here both commands' Python entry points run in a copy of the
working tree, the demo shortened, then the tests that collided, with the suite's check that no
test writes into the repository (tests/repo_guard.py) watching the copy.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh_copy(to) -> None:
    """The files git would commit, as they are in the working tree (what a clone of it holds)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):  # a file deleted in the working tree is not in the copy
            os.makedirs(os.path.join(to, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(source, os.path.join(to, name))


@pytest.mark.slow
def test_the_tests_pass_after_the_demo_left_its_run_in_the_clone(tmp_path):
    clone = tmp_path / "jaxrl"
    _fresh_copy(clone)
    # A user's shell: one CPU device, no test settings; `python -m` puts the clone first on sys.path.
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER")}
    quiet = ["logging.tensorboard=false", "logging.plots=false"]
    demo = subprocess.run(
        [sys.executable, "-m", "jaxrl.cli", "demo", "--sft", "sft.stages=[{steps: 20, max_length: 16}]", *quiet,
         "--rl", "steps=2", "eval.max_prompts=8", *quiet],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    # Two RL steps cannot reach the demo's rise target (exit 1 then); the run itself must be whole.
    assert demo.returncode in (0, 1) and "[demo]   before RL" in demo.stdout, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert os.listdir(clone / "runs" / "demo" / "rl" / "checkpoints")  # the run a colliding test would meet
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/distributed/test_host_memory.py"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-5000:] + tests.stderr[-3000:]
    assert "wrote into the repository" not in tests.stdout
