"""Host memory of XLA:CPU programs: each call's scratch buffer stays mapped from one call to the next.

XLA:CPU gives every call of a compiled program one temporary buffer (activations and gradients:
95 MiB for the update of ``bench/vs_tunix.py``'s large model, ``memory_analysis().temp_size_in_bytes``)
from ``malloc`` and frees it when the call returns. glibc serves a block that large with a fresh
``mmap`` and unmaps it on ``free`` (above 32 MiB always; above 64 MiB in any thread but the main
one, and JAX runs CPU programs on helper threads when its CPU dispatch is asynchronous), so every
call faults each page of it in again and the kernel zeroes them: about 24,600 minor faults and
60-80 ms of kernel time per RL step of that model, where the update itself takes 150-170 ms.

Two settings keep the buffer mapped, both for CPU programs only:

- :func:`before_devices` (run by :func:`jaxrl.distributed.initialize`, so first thing in every
  command): JAX's CPU client dispatches synchronously, so a program runs, and allocates, on the
  thread that calls it. Only the CPU client reads this setting (GPU and TPU dispatch as before);
- :func:`keep_freed_memory` (run by the trainers once their mesh is on CPU devices and the CPU
  client is synchronous): glibc's main heap serves large blocks too and keeps up to 2 GiB freed at
  its top instead of returning it, so the next call reuses the same pages. The process keeps its
  peak memory instead of handing it back between calls.

Measured on bench/vs_tunix.py's large model (4 layers, hidden 256; one RL step, these 2 CPU cores):
minor faults 24,600 -> 20 per step, kernel time 62-79 -> 7-9 ms, update 160-191 -> 127-151 ms.
``JAXRL_CPU_KEEP_BUFFERS=0`` turns both off; an explicit ``JAX_CPU_ENABLE_ASYNC_DISPATCH`` is left
as set (and with asynchronous dispatch the heap setting would gain nothing, so it is not applied).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

import jax

ENV = "JAXRL_CPU_KEEP_BUFFERS"
_ASYNC_ENV = "JAX_CPU_ENABLE_ASYNC_DISPATCH"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_KEEP_AT_TOP = 2**31 - 1  # mallopt takes an int: the most freed memory the heap's top may keep

log = logging.getLogger(__name__)


def _enabled() -> bool:
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: set it to 1 (the default: keep XLA:CPU's scratch buffers "
                         "mapped) or 0 (off)")
    return value == "1" and platform.libc_ver()[0] == "glibc"


def before_devices() -> bool:
    """Makes JAX's CPU client synchronous, unless ``JAXRL_CPU_KEEP_BUFFERS=0``, the user set
    ``JAX_CPU_ENABLE_ASYNC_DISPATCH``, this is no glibc system, or JAX's backends already exist
    (the client reads the setting once, when it starts). Returns whether it did."""
    from jax._src import xla_bridge  # noqa: PLC0415 (the only way to ask without starting them)

    if not _enabled() or _ASYNC_ENV in os.environ or xla_bridge.backends_are_initialized():
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


def keep_freed_memory(mesh: jax.sharding.Mesh) -> bool:
    """With ``mesh`` on CPU devices and a synchronous CPU client: glibc keeps large freed blocks in
    its main heap (``mallopt``: no ``mmap`` for large blocks, 2 GiB trim threshold). Returns whether
    it did; a no-op otherwise (GPU and TPU learners, ``JAXRL_CPU_KEEP_BUFFERS=0``, asynchronous
    dispatch, no glibc)."""
    if (not _enabled() or jax.config.read("jax_cpu_enable_async_dispatch")
            or {d.platform for d in mesh.devices.flat} != {"cpu"}):
        return False
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_AT_TOP)):
        log.warning("glibc refused mallopt; XLA:CPU's scratch buffers will be mapped afresh at every call")
        return False
    return True
