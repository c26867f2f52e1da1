"""NVIDIA GPU topologies for ahead-of-time compilation on a machine without a GPU.

XLA's GPU compiler needs no GPU when it is given a *target config*: a ``stream_executor.GpuTargetConfigProto``
describing the chip (SM count, shared memory, compute capability, memory). The JAX CUDA plugin
(``jax-cuda12-plugin``, installed into ``.venv-cuda-aot`` by ``scripts/setup_cuda_aot.sh``) takes it through
``jax.experimental.topologies``, as libtpu takes a TPU topology's name, and brings its own ptxas and cuDNN:
the compiled program is the one the GPUs would run, cuDNN fused attention included.

A topology is named ``CHIP:HOSTSxGPUS`` (``h100:2x8``: 2 hosts of 8 H100s, 16 devices over 2 processes);
``CHIP`` is a key of :data:`GPUS`. Each chip's target config is written here from its published figures:
NVIDIA's datasheets for SMs, clocks, shared memory, L2, memory bandwidth and dense bf16 tensor-core peak;
the memory is the ``totalGlobalMem`` the CUDA runtime reports for the chip (a little below the marketing
"80GB"; the figures XLA's own device specs record), because that is what JAX budgets from.
"""

from __future__ import annotations

import dataclasses
import re

from jaxrl.errors import InputError


@dataclasses.dataclass(frozen=True)
class GpuChip:
    """One NVIDIA GPU: what the target config describes and what the compile report needs."""

    device_kind: str  # the device_description_str JAX reports as device_kind
    memory_bytes: int
    peak_bf16_flops: float  # dense tensor-core bf16
    memory_bandwidth: float  # bytes/s
    compute_capability: tuple[int, int]
    sm_count: int
    fp32_units_per_sm: int
    boost_clock_ghz: float
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int


GPUS: dict[str, GpuChip] = {
    # A100 SXM4 80GB: 108 SMs x 64 FP32 cores at 1.41 GHz, 2.039 TB/s HBM2e, 40 MB L2, 164 KB shared memory
    # per SM, 312 TFLOP/s dense bf16.
    "a100": GpuChip("NVIDIA A100-SXM4-80GB", 85_100_068_864, 312e12, 2.039e12, (8, 0), 108, 64, 1.41,
                    40 << 20, 164 << 10, 163 << 10),
    # H100 SXM5 80GB: 132 SMs x 128 FP32 cores at 1.98 GHz, 3.35 TB/s HBM3, 50 MB L2, 228 KB shared memory
    # per SM, 989 TFLOP/s dense bf16.
    "h100": GpuChip("NVIDIA H100 80GB HBM3", 84_942_979_072, 989e12, 3.35e12, (9, 0), 132, 128, 1.98,
                    50 << 20, 228 << 10, 227 << 10),
    # H200 SXM 141GB: the H100's compute with 141 GB of HBM3e at 4.8 TB/s.
    "h200": GpuChip("NVIDIA H200", 151_397_597_184, 989e12, 4.8e12, (9, 0), 132, 128, 1.98,
                    50 << 20, 228 << 10, 227 << 10),
    # B200 (HGX B200): 148 SMs x 128 FP32 cores, 180 GB HBM3e at 8 TB/s, 126 MB L2, 2.25 PFLOP/s dense bf16.
    "b200": GpuChip("NVIDIA B200", 191_514_411_008, 2.25e15, 8.0e12, (10, 0), 148, 128, 1.965,
                    126 << 20, 228 << 10, 227 << 10),
}
# The cuDNN the plugin's wheels bring (nvidia-cudnn-cu12 9.x): what XLA checks cuDNN fused attention against.
CUDNN_VERSION = (9, 8)
_NAME = re.compile(r"^([a-z0-9]+):(\d+)x(\d+)$")


def parse_topology(name: str) -> tuple[str, int, int] | None:
    """``(chip, hosts, gpus_per_host)`` of a GPU topology name (``h100:2x8``); None for a name that is not
    one (a TPU topology); InputError for a GPU name that is malformed or names an unknown chip."""
    match = _NAME.match(name.lower())
    if match is None:
        if name.split(":")[0].lower() in GPUS:
            raise InputError(f"--topology {name!r}: a GPU topology is CHIP:HOSTSxGPUS, e.g. h100:2x8 (2 hosts of "
                             f"8 GPUs); chips: {', '.join(sorted(GPUS))}")
        return None
    chip, hosts, per_host = match.group(1), int(match.group(2)), int(match.group(3))
    if chip not in GPUS:
        if chip.startswith("v") and chip[1:2].isdigit():
            return None  # a TPU generation (v5e:2x2): libtpu's to read
        raise InputError(f"--topology {name!r}: unknown GPU {chip!r}; GPU topologies are CHIP:HOSTSxGPUS with "
                         f"CHIP one of {', '.join(sorted(GPUS))} (TPU topologies as JAX names them: v5e:2x2, "
                         "v5p:4x4x2, ...)")
    if hosts < 1 or not 1 <= per_host <= 8:
        raise InputError(f"--topology {name!r}: HOSTS must be >= 1 and GPUS (per host) 1 to 8")
    return chip, hosts, per_host


def target_config(chip: GpuChip) -> str:
    """The ``GpuTargetConfigProto`` text of ``chip`` that XLA compiles against."""
    major, minor = chip.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {chip.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {chip.sm_count}
  fpus_per_core: {chip.fp32_units_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.memory_bandwidth)}
  l2_cache_size: {chip.l2_bytes}
  clock_rate_ghz: {chip.boost_clock_ghz}
  device_memory_size: {chip.memory_bytes}
  shared_memory_per_block_optin: {chip.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {CUDNN_VERSION[0]} minor: {CUDNN_VERSION[1]} }}
device_description_str: "{chip.device_kind}"
"""


def gpu_devices(chip: str, hosts: int, per_host: int) -> list:
    """The ``hosts x per_host`` devices of a described GPU topology (one process per host)."""
    from jax.experimental import topologies

    try:
        import jax_cuda12_plugin  # noqa: F401  (XLA's GPU compiler; nothing runs on a GPU)
    except ImportError:
        raise InputError("jaxrl compile for GPUs needs the JAX CUDA plugin: run it with .venv-cuda-aot/bin/python "
                         "(bash scripts/setup_cuda_aot.sh)") from None
    description = topologies.get_topology_desc(f"{chip}:{hosts}x{per_host}", "cuda",
                                               target_config=target_config(GPUS[chip]),
                                               topology=f"1x{hosts}x{per_host}")
    return list(description.devices)


def chip_of(device_kind: str) -> GpuChip | None:
    """The chip whose target config describes devices of ``device_kind``."""
    return next((chip for chip in GPUS.values() if chip.device_kind == device_kind), None)
