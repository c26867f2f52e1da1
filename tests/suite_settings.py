"""The JAX and XLA settings of the test suite, for the pytest processes (tests/conftest.py) and the
processes tests start with an environment of their own (tests/distributed/jax_processes.py).

- 8 CPU devices, so mesh tests run in one process.
- CPU collectives wait up to 600 s for every device: XLA aborts the process (SIGABRT, "Fatal
  Python error: Aborted") when one simulated device reaches a collective 40 s (its default) after
  the others, and on a loaded 2-core machine the 8 devices' threads of a 32K-token step can fall
  that far apart. A real deadlock still ends the test at its timeout (pyproject.toml).
- ``JAX_DISABLE_MOST_OPTIMIZATIONS``: XLA's LLVM backend compiles at optimisation level 0. The
  tests' programs are tiny and compiled far more often than they run, so this cuts the suite's
  time by about a quarter; the HLO passes (fusion, sharding, buffer assignment: the memory
  figures tests check) are unchanged. Model numerics compared with transformers run fully
  optimised, as users compile them (tests/models/conftest.py).
- ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU emits its fusions with the elemental IR
  emitters it used before the MLIR fusion emitters, which compile a tiny program in about a third
  less time. Measured on a 2-core machine, one RL step of the trainer tests' toy model (model
  init, sampler, scorer, train step; no persistent cache): 12.2 s -> 7.9 s for the first trainer
  in a process, 4.5 s -> 2.2 s for a second one. Programs and their memory plans are the same
  HLO; only the machine code differs, and every comparison in the suite is between programs
  compiled under the same flags or to a tolerance.
"""

CPU_DEVICES = 8
CPU_COLLECTIVE_TIMEOUT_S = 600

# The settings (made by tests/conftest.py) that processes started by tests keep: the persistent
# compilation cache and the compiler's optimisation level.
KEPT_JAX_SETTINGS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_DISABLE_MOST_OPTIMIZATIONS")


def xla_flags(devices: int = CPU_DEVICES) -> str:
    """``XLA_FLAGS`` for a test process with ``devices`` CPU devices."""
    return (f"--xla_force_host_platform_device_count={devices} "
            f"--xla_cpu_collective_call_terminate_timeout_seconds={CPU_COLLECTIVE_TIMEOUT_S} "
            "--xla_cpu_use_fusion_emitters=false")
