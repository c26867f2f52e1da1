"""The compile report: per program and per chip, memory against HBM, FLOPs and a roofline lower bound.

Chip figures per TPU generation come from Google Cloud's TPU system-architecture pages
(cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e): HBM per chip, peak bf16 FLOP/s and HBM bandwidth;
per NVIDIA GPU from jaxrl.compile.gpus (the datasheets). A topology described on a machine without
its chips has no addressable devices, so ``device.memory_stats()`` (which would give ``bytes_limit``)
is refused; it is used when it answers. On a GPU, JAX takes only a share of the memory
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 unless set; ``placement.learner_memory_fraction`` sets it),
and that share is what a program must fit in.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from jaxrl.compile import gpus
from jaxrl.compile.aot import Compiled

GIB = 2.0 ** 30
DOCS = "Cloud TPU system architecture docs (cloud.google.com/tpu/docs/system-architecture-tpu-vm)"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip: HBM bytes, peak bf16 FLOP/s, HBM bytes/s."""

    name: str
    hbm_bytes: float
    peak_flops: float
    hbm_bandwidth: float


# jax's device_kind -> the chip (per chip; a chip that shows as two devices splits them evenly).
CHIPS: dict[str, Chip] = {
    "TPU v4": Chip("v4", 32 * GIB, 275e12, 1.2e12),
    "TPU v5 lite": Chip("v5e", 16 * GIB, 197e12, 819e9),
    "TPU v5": Chip("v5p", 95 * GIB, 459e12, 2.765e12),
    "TPU v6 lite": Chip("v6e", 32 * GIB, 918e12, 1640e9),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """The device the programs were compiled for, its share of a chip, and where its figures came from."""

    topology: str
    devices: int
    chip: Chip
    devices_per_chip: int
    hbm_bytes: float
    hbm_source: str

    @property
    def peak_flops(self) -> float:
        return self.chip.peak_flops / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float:
        return self.chip.hbm_bandwidth / self.devices_per_chip


JAX_GPU_MEMORY_FRACTION = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION


def target_for(topology: str, devices: list, memory_fraction: float | None = None) -> Target:
    """The Target of ``devices`` (a topology's): chip figures from CHIPS, HBM from ``memory_stats()``
    when the device answers (never for a described topology without its chips), else from CHIPS; on a
    GPU the share of it JAX takes, ``memory_fraction`` (default: JAX's, 0.75)."""
    kind = devices[0].device_kind
    gpu = gpus.chip_of(kind)
    if gpu is not None:
        fraction = JAX_GPU_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        chip = Chip(kind, gpu.memory_bytes, gpu.peak_bf16_flops, gpu.memory_bandwidth)
        return Target(topology, len(devices), chip, 1, fraction * gpu.memory_bytes,
                      f"the datasheet's {gpu.memory_bytes / GIB:.2f} GiB (CUDA's totalGlobalMem) x {fraction:g}, the "
                      "share JAX takes (XLA_PYTHON_CLIENT_MEM_FRACTION; placement.learner_memory_fraction)")
    if kind not in CHIPS:
        raise ValueError(f"device kind {kind!r} has no entry in jaxrl.compile.report.CHIPS ({sorted(CHIPS)})")
    chip = CHIPS[kind]
    dims = topology.split(":")[-1].split("x")
    chips = math.prod(int(d) for d in dims) if all(d.isdigit() for d in dims) else len(devices)
    per_chip = max(1, len(devices) // (chips * max(1, len({getattr(d, "slice_index", 0) for d in devices}))))
    try:
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # a described (non-addressable) device refuses memory_stats: the table is the source
        limit = None
    if limit:
        return Target(topology, len(devices), chip, per_chip, float(limit), "device.memory_stats()['bytes_limit']")
    source = f"{DOCS}: {chip.name} {chip.hbm_bytes / GIB:.0f} GiB per chip"
    return Target(topology, len(devices), chip, per_chip, chip.hbm_bytes / per_chip,
                  source + (f" / {per_chip} devices per chip" if per_chip > 1 else ""))


def roofline_seconds(result: Compiled, target: Target) -> float:
    """A lower bound on the program's time: its FLOPs at peak, or its unavoidable HBM traffic at full bandwidth."""
    program = result.program
    flops = max(result.xla_flops + program.kernel_flops / target.devices, program.model_flops / target.devices)
    return max(flops / target.peak_flops, program.min_hbm_bytes / target.hbm_bandwidth)


def fits(result: Compiled, target: Target) -> bool:
    return not result.refused and result.total_bytes <= target.hbm_bytes


def advice(result: Compiled) -> str:
    """The config keys that shrink this program's memory."""
    name = result.program.name
    if name == "train_step":
        return ("raise update.micro_batches (fewer rows per backward), model.remat=full (fewer saved activations), "
                "or more mesh.fsdp / mesh.tensor (smaller weight and optimizer shards)")
    if name.startswith("sft_step"):
        return ("raise sft.micro_batches (fewer rows per backward), model.remat=full, more mesh.sequence (a row's "
                "tokens over more chips) or more mesh.fsdp / mesh.tensor")
    if name.endswith("sampler"):
        return ("lower rollout.prompts_per_step or rollout.group_size (fewer rows decoded at once, a smaller KV "
                "cache), or more mesh.tensor (KV heads split over chips)")
    return "raise update.micro_batches (fewer rows per scorer call) or more mesh.fsdp / mesh.tensor"


def refusals(results: list[Compiled], target: Target) -> list[str]:
    """One line per program that does not fit the device's HBM."""
    return [f"{r.program.name} needs {r.total_bytes / GIB:.2f} GiB per device ({r.total_bytes} bytes"
            f"{', XLA refused to compile it: ' + r.refused if r.refused else ''}) but a {target.chip.name} device "
            f"has {target.hbm_bytes / GIB:.2f} GiB HBM for it; {advice(r)}" for r in results if not fits(r, target)]


def table(results: list[Compiled], target: Target) -> str:
    """The per-device table (GiB; TFLOP; ms), one row per program."""
    head = (f"{'program':<19}{'args':>8}{'out':>8}{'temp':>8}{'held':>7}{'total':>8}{'HBM':>7}{'fits':>6}"
            f"{'XLA TFLOP':>11}{'kernel':>10}{'model':>10}{'roofline ms':>13}{'compile s':>11}")
    lines = [head]
    for r in results:
        p = r.program
        lines.append(
            f"{p.name:<19}{r.argument_bytes / GIB:>8.2f}{(r.output_bytes - r.alias_bytes) / GIB:>8.2f}"
            f"{r.temp_bytes / GIB:>8.2f}{p.resident_bytes / GIB:>7.2f}{r.total_bytes / GIB:>8.2f}"
            f"{target.hbm_bytes / GIB:>7.1f}{'yes' if fits(r, target) else 'NO':>6}{r.xla_flops / 1e12:>11.1f}"
            f"{p.kernel_flops / target.devices / 1e12:>10.1f}{p.model_flops / target.devices / 1e12:>10.1f}"
            f"{roofline_seconds(r, target) * 1e3:>13.1f}{r.compile_seconds:>11.1f}")
    return "\n".join(lines)


NOTES = (
    "GiB per device. args/out/temp: compiled.memory_analysis() (out less donated aliases); held: buffers alive "
    "beside the program but not its arguments (optimizer state during scoring and sampling, the KL reference's "
    "copy); total = args + out + temp + code + held.",
    "XLA TFLOP: compiled.cost_analysis() per device; XLA counts a loop body once (the micro-batch scan, the "
    "scanned layers, the decode while-loop, the chunked LM head) and not at all custom calls such as Pallas "
    "kernels. kernel: the Pallas kernels' FLOPs, analytic: splash attention (causal forward 2*B*H*T^2*D per "
    "layer, backward 2.5x) and the MoE experts' gmm/tgmm (2 x tokens x k x 3*D*I per MoE layer forward, 2x that "
    "backward). model: analytic matmul (6N per trained token, 2N per scored or decoded one) + attention FLOPs per "
    "device.",
    "roofline: max(max(XLA + kernel, model) FLOPs / peak, unavoidable HBM bytes / bandwidth): the train step "
    "reads and writes its state, a scorer reads the weights, each decode step re-reads the weights (KV cache "
    "reads not counted); a lower bound, not a prediction.",
)


def as_json(config_path: str, model_source: str, target: Target, results: list[Compiled], mesh: dict) -> dict[str, Any]:
    """The report as a JSON-ready dict."""
    return {
        "config": config_path, "model": model_source, "topology": target.topology, "devices": target.devices,
        "chip": dataclasses.asdict(target.chip), "devices_per_chip": target.devices_per_chip, "mesh": mesh,
        "hbm_bytes_per_device": target.hbm_bytes, "hbm_source": target.hbm_source,
        "fits": all(fits(r, target) for r in results), "notes": list(NOTES),
        "programs": [{
            "name": r.program.name, "what": r.program.what, "argument_bytes": r.argument_bytes,
            "output_bytes": r.output_bytes, "alias_bytes": r.alias_bytes, "temp_bytes": r.temp_bytes,
            "code_bytes": r.code_bytes, "resident_bytes": r.program.resident_bytes, "total_bytes": r.total_bytes,
            "fits": fits(r, target), "refused": r.refused, "headroom_bytes": target.hbm_bytes - r.total_bytes,
            "xla_flops": r.xla_flops, "kernel_flops_per_device": r.program.kernel_flops / target.devices,
            "model_flops_per_device": r.program.model_flops / target.devices,
            "roofline_seconds": roofline_seconds(r, target), "compile_seconds": r.compile_seconds,
            "kernels": list(r.kernels),
        } for r in results],
    }


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
