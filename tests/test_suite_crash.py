"""A test that takes its worker down ends the suite at once, naming the test (pyproject.toml's
``--max-worker-restart=0``). Without it pytest-xdist 3.8 replaces the worker under ``--dist loadgroup``
(scripts/test.sh) and then waits forever with both workers idle: a loaded CI machine once hung there
after ``Fatal Python error: Aborted`` in a memory-heavy test, until the job's time limit."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CRASHING = '''
import os, pytest
pytestmark = pytest.mark.xdist_group("heavy")
def test_before(): pass
def test_aborts(): os.abort()  # what the kernel's OOM killer or a native crash does to a worker
def test_after(): pass
'''
OTHERS = '''
import time, pytest
@pytest.mark.parametrize("i", range(6))
def test_other(i): time.sleep(0.5)
'''


def test_a_crashed_worker_ends_the_run_naming_its_test_instead_of_hanging(tmp_path):
    (tmp_path / "test_crashing.py").write_text(CRASHING)
    (tmp_path / "test_others.py").write_text(OTHERS)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    # The suite's own settings (pyproject.toml) and scheduling (scripts/test.sh) on two small files.
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", os.path.join(ROOT, "pyproject.toml"),
                           "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-q", "-n", "2", "--dist",
                           "loadgroup", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "crashed while running 'test_crashing.py::test_aborts" in done.stdout, done.stdout[-3000:]
    assert "FAILED test_crashing.py::test_aborts" in done.stdout
