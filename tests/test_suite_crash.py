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


# One of 8 CPU devices reaches the all-reduce STALL_S seconds after the others.
STALLED_COLLECTIVE = '''
import time
import jax, jax.numpy as jnp
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("x",))
def stall(shard):
    if int(shard[0]) == 0:
        time.sleep({stall_s})
    return shard
@jax.jit
@jax.shard_map(mesh=mesh, in_specs=P("x"), out_specs=P())
def total(v):
    return jax.lax.psum(io_callback(stall, jax.ShapeDtypeStruct(v.shape, v.dtype), v), "x")
print("total", float(total(jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x"))))[0]))
'''


def test_a_simulated_device_late_to_a_collective_does_not_abort_the_worker():
    """XLA:CPU aborts the process (SIGABRT, a crashed worker) when one simulated device reaches a
    collective its terminate timeout (40 s by default) after the others; on a loaded 2-core machine
    the 32K context-parallel test's devices fell that far apart. The suite's XLA flags
    (tests/suite_settings.py) allow CPU_COLLECTIVE_TIMEOUT_S more. Shown with a 4 s stall and XLA's
    "may be stuck" warning after 1 s (the wait before the terminate timeout starts; 20 s by default):
    the suite's flags survive it, the same flags with a 2 s terminate timeout abort."""
    import suite_settings

    def run(flags: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", STALLED_COLLECTIVE.replace("{stall_s}", "4")], env=env,
                              capture_output=True, text=True, timeout=120)

    suite = suite_settings.xla_flags() + " --xla_cpu_collective_call_warn_stuck_timeout_seconds=1"
    survived = run(suite)
    assert survived.returncode == 0 and "total 28.0" in survived.stdout, survived.stderr[-2000:]
    short = run(suite.replace(f"={suite_settings.CPU_COLLECTIVE_TIMEOUT_S}", "=2"))
    assert short.returncode == -6 and "Termination timeout" in short.stderr, (short.returncode, short.stderr[-2000:])
