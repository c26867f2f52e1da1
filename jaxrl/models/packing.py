"""Sequence packing: several samples per row for the learner's forward, one sample per row for the loss.

A step's samples have very different lengths; padding each to the longest wastes most of
the learner's compute on a long-tailed length mix. :func:`pack_rows` places the samples'
next-token columns back to back in rows of ``length`` columns (first-fit decreasing), each
sample its own segment (ids 1, 2, ... within a row; 0 = padding) with its own positions, so
attention never crosses samples (softmax layers mask by segment, linear-attention layers
reset their state at segment starts). The model runs on the packed rows;
:meth:`PackedRows.unpack` gathers its per-token outputs back to the one-sample-per-row layout
every loss and metric reads, so no loss, normaliser or sequence-level statistic (GSPO ratios,
sequence-level MIS, ``seq-mean`` aggregations) can mix two samples, and the update equals the
unpacked one up to float rounding.

The trainers' update and the learner's recompute (``jaxrl.models.scoring``) both pack.
Micro-batches split rows with a stride (``trainer.update.split_micro_batches``): micro-batch
``m`` holds samples ``m, m + M, ...`` and packed rows ``m, m + M, ...``. So samples are packed
within their micro-batch group only, and each sample's gather index points into its own
micro-batch's rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each bin's lengths summing to at most ``capacity``: items in order of
    decreasing length, each into the first bin it fits (ties keep index order, so the packing is
    deterministic). Zero-length items take no room but still get a bin slot."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"an item of length {max(lengths)} does not fit in rows of {capacity} columns")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _bucket(rows: int, limit: int, multiple: int) -> int:
    """``rows`` rounded up to a power of two (a few compiled shapes, not one per batch) and to a
    multiple of ``multiple`` (rows spread evenly over data-parallel devices), at most ``limit``
    rounded up to that multiple."""
    rows = 1 << max(rows - 1, 0).bit_length()
    rows = min(rows, limit)
    return -(-rows // multiple) * multiple


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Packed model inputs [R, L] int32 and, for each sample column [N, T], the flat index of its
    cell in its micro-batch's packed rows (``R / M * L`` = out of range for the sample's padding,
    which unpacks to 0); with routing replay the samples' routes [R, L, MoE layers, k] int32
    packed the same way (-1 on padding), else None."""

    input_ids: Any
    positions: Any
    segment_ids: Any
    targets: Any
    gather: Any
    routed_experts: Any = None

    def model_inputs(self) -> tuple[Any, Any, Any, Any]:
        return self.input_ids, self.positions, self.segment_ids, self.targets

    def unpack(self, values: jax.Array) -> jax.Array:
        """Per-token values of the packed rows [R, L] -> the samples' layout [N, T] (0 on padding)."""
        return jnp.take(values.reshape(-1), self.gather, mode="fill", fill_value=0)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - float((np.asarray(self.segment_ids) > 0).mean())


def pack_rows(input_ids: np.ndarray, positions: np.ndarray, segment_ids: np.ndarray, targets: np.ndarray, *,
              groups: int = 1, devices: int = 1, routed_experts: np.ndarray | None = None) -> PackedRows:
    """Packs one-sample rows (next-token aligned, real columns first: ``segment_ids`` 1 then 0) into
    rows of the same length; ``routed_experts`` [N, T, MoE layers, k] (or None) travel with their
    columns.

    Sample ``i`` shares rows only with samples of its group ``i % groups``; packed row ``j``
    belongs to group ``j % groups``. Every group gets the same number of rows (a power of two,
    at most the group's sample count) so micro-batches have one shape, and all the rows together
    split evenly over ``devices`` data-parallel devices.
    """
    n, length = np.shape(input_ids)
    if n % groups:
        raise ValueError(f"{n} rows do not split into {groups} micro-batch groups")
    lengths = np.asarray(segment_ids > 0).sum(axis=1)
    members = [np.arange(m, n, groups) for m in range(groups)]
    bins = [first_fit_decreasing(lengths[idx].tolist(), length) for idx in members]
    rows = _bucket(max(len(b) for b in bins), n // groups, devices // math.gcd(devices, groups))
    packed = {name: np.zeros((rows * groups, length), np.int32) for name in ("input_ids", "positions", "segment_ids",
                                                                            "targets")}
    gather = np.full((n, length), rows * length, np.int32)
    routes = None
    if routed_experts is not None:
        routed_experts = np.asarray(routed_experts)
        routes = np.full((rows * groups, length, *routed_experts.shape[2:]), -1, np.int32)
    for m, (idx, group_bins) in enumerate(zip(members, bins, strict=True)):
        for local_row, members_of_row in enumerate(group_bins):
            row, offset = local_row * groups + m, 0
            for segment, k in enumerate(members_of_row, start=1):
                i, width = idx[k], lengths[idx[k]]
                cols = slice(offset, offset + width)
                packed["input_ids"][row, cols] = input_ids[i, :width]
                packed["targets"][row, cols] = targets[i, :width]
                packed["positions"][row, cols] = positions[i, :width]
                packed["segment_ids"][row, cols] = segment
                if routes is not None:
                    routes[row, cols] = routed_experts[i, :width]
                gather[i, :width] = local_row * length + offset + np.arange(width)
                offset += width
    return PackedRows(**packed, gather=gather, routed_experts=routes)
