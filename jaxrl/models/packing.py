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

from jaxrl.models.attention import resolve_attention_impl, tail_segment


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


def unpack(values: jax.Array, gather: jax.Array) -> jax.Array:
    """Per-token values of packed rows [R, L] -> the samples' layout [N, T] by ``PackedRows.gather`` (0 on
    padding; a shared prefix's value goes to every sample of its group, and its gradient sums theirs)."""
    return jnp.take(values.reshape(-1), gather, mode="fill", fill_value=0)


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
        return unpack(values, self.gather)

    @property
    def real_cells(self) -> int:
        """The rows' non-padding columns: what the learner computes (a shared prefix counts once)."""
        return int((np.asarray(self.segment_ids) > 0).sum())

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_cells / np.size(self.segment_ids)


def shared_prefix_blocker(config, backend: str | None = None) -> str | None:
    """Why the model of ``config`` (a ``ModelConfig``) cannot run rows with shared prefixes on
    ``backend`` (default: the mesh's platform), or None when it can."""
    recurrent = sorted(set(config.layer_types) - {"full_attention"})
    if recurrent:
        return (f"its {recurrent} layers carry a recurrent state along the row, so a tail cannot continue its "
                "prompt from one copy")
    if resolve_attention_impl(config.attention_impl, backend) == "splash":
        return ("the splash kernel masks by segment equality only, so a tail could not see its prompt; set "
                "model.attention_impl: chunked (or xla)")
    return None


@dataclasses.dataclass(frozen=True)
class _Item:
    """What one packed item lays out: ``leader``'s first ``shared`` columns once (the prefix), then
    each member's columns from ``shared`` on (its tail). Without sharing: one member, ``shared`` its
    length, no tail."""

    leader: int
    shared: int
    members: tuple[int, ...]

    def width(self, lengths: np.ndarray) -> int:
        return self.shared + sum(int(lengths[i]) - self.shared for i in self.members)


def _clusters(idx: np.ndarray, lengths: np.ndarray, prefix_groups: np.ndarray | None,
              columns: Sequence[np.ndarray]) -> list[_Item]:
    """One micro-batch group's samples as unsplit items: each sample alone, or, with ``prefix_groups``,
    the samples of one prefix group with the leading columns all of them have equal in every array
    of ``columns`` (none in common: each alone)."""
    if prefix_groups is None:
        return [_Item(int(i), int(lengths[i]), (int(i),)) for i in idx]
    clusters: dict[int, list[int]] = {}
    for i in idx:
        clusters.setdefault(int(prefix_groups[i]) if prefix_groups[i] >= 0 else -1 - int(i), []).append(int(i))
    items = []
    for members in clusters.values():
        n = int(lengths[members].min())
        same = np.ones(n, bool)
        for x in columns:  # [members, n, ...] == the first member's -> equal in every member and entry
            same &= np.all((x[members, :n] == x[members[:1], :n]).reshape(len(members), n, -1), axis=(0, 2))
        shared = n if same.all() else int(np.argmin(same))
        if len(members) == 1 or shared == 0:
            items += [_Item(i, int(lengths[i]), (i,)) for i in members]
        else:
            items.append(_Item(members[0], shared, tuple(members)))
    return items


def _items(clusters: list[_Item], lengths: np.ndarray, row_length: int) -> list[_Item]:
    """``clusters`` split to fit rows of ``row_length``: as many tails per item as fit, an item that does
    not fit starts another copy of the prefix."""
    items = []
    for cluster in clusters:
        current: list[int] = []
        for i in cluster.members:
            if current and dataclasses.replace(cluster, members=(*current, i)).width(lengths) > row_length:
                items.append(dataclasses.replace(cluster, members=tuple(current)))
                current = []
            current.append(i)
        items.append(dataclasses.replace(cluster, members=tuple(current)))
    return items


def _row_lengths(length: int) -> list[int]:
    """Row lengths a shared-prefix layout may take: ``length x 2^(j/4)``, j = 0 .. 4 (a few shapes, so
    few compiled programs), each rounded up to a multiple of the largest power of two (at most 128)
    that divides ``length``, so rows still split over the devices that split ``length`` (context
    parallelism). At most ``2 x length``: a softmax layer's work per token grows with its row (each
    query is compared with every key of the row, also the ones its mask hides), so a row of a whole
    large group would cost more in attention than it saves in the other layers."""
    quantum = min(length & -length, 128)
    return sorted({-(-math.ceil(length * 2 ** (j / 4)) // quantum) * quantum for j in range(5)})


def pack_rows(input_ids: np.ndarray, positions: np.ndarray, segment_ids: np.ndarray, targets: np.ndarray, *,
              groups: int = 1, devices: int = 1, routed_experts: np.ndarray | None = None,
              prefix_groups: np.ndarray | None = None) -> PackedRows:
    """Packs one-sample rows (next-token aligned, real columns first: ``segment_ids`` 1 then 0) into
    rows; ``routed_experts`` [N, T, MoE layers, k] (or None) travel with their columns.

    Sample ``i`` shares rows only with samples of its group ``i % groups``; packed row ``j``
    belongs to group ``j % groups``. Every group gets the same number of rows (a power of two,
    at most the group's sample count) so micro-batches have one shape, and all the rows together
    split evenly over ``devices`` data-parallel devices.

    Rows have the samples' length ``T``, unless ``prefix_groups`` [N] int is given: samples with the
    same non-negative value (e.g. a GRPO group's, which share their prompt) lay out the leading
    columns they all have in common once, as a prefix segment, each followed by its own columns as a
    tail segment that also attends to the prefix (``jaxrl.models.attention.tail_segment``). The
    rows then take the length of :func:`_row_lengths` whose layout has the fewest cells (padding
    included; the shortest of a tie), so a group's tails can follow one copy of its prompt. Every
    sample's per-token outputs are unchanged (up to float rounding): a tail sees exactly the keys its
    unshared sequence saw, and the unpack gather copies the prefix's outputs to every member (its
    gradient sums theirs).
    """
    n, length = np.shape(input_ids)
    if n % groups:
        raise ValueError(f"{n} rows do not split into {groups} micro-batch groups")
    lengths = np.asarray(segment_ids > 0).sum(axis=1)
    members = [np.arange(m, n, groups) for m in range(groups)]
    multiple = devices // math.gcd(devices, groups)
    columns = [np.asarray(x) for x in (input_ids, positions, targets)]
    if routed_experts is not None:
        routed_experts = np.asarray(routed_experts)
        columns.append(routed_experts)
    clusters = [_clusters(idx, lengths, prefix_groups, columns) for idx in members]
    candidates = [length] if prefix_groups is None else _row_lengths(length)
    best = None
    for row_length in candidates:  # the row length whose layout has the fewest cells
        items = [_items(group, lengths, row_length) for group in clusters]
        bins = [first_fit_decreasing([item.width(lengths) for item in group], row_length) for group in items]
        rows = _bucket(max(len(b) for b in bins), n // groups, multiple)
        if best is None or rows * row_length < best[0] * best[1]:
            best = (rows, row_length, items, bins)
    return _lay_out(*best, groups, lengths, columns, n, length)


def _lay_out(rows: int, row_length: int, items: list[list[_Item]], bins: list[list[list[int]]], groups: int,
             lengths: np.ndarray, columns: list[np.ndarray], n: int, length: int) -> PackedRows:
    """The packed arrays of ``items`` placed as ``bins`` say (bin b of group m is row ``b * groups + m``)."""
    input_ids, positions, targets = columns[:3]
    routed_experts = columns[3] if len(columns) > 3 else None
    packed = {name: np.zeros((rows * groups, row_length), np.int32) for name in ("input_ids", "positions",
                                                                                "segment_ids", "targets")}
    gather = np.full((n, length), rows * row_length, np.int32)
    routes = None
    if routed_experts is not None:
        routes = np.full((rows * groups, row_length, *routed_experts.shape[2:]), -1, np.int32)

    def place(local_row, m, offset, sample, cols, segment):  # sample's columns `cols` at `offset` of the row
        width, row = cols.stop - cols.start, local_row * groups + m
        at = slice(offset, offset + width)
        packed["input_ids"][row, at] = input_ids[sample, cols]
        packed["targets"][row, at] = targets[sample, cols]
        packed["positions"][row, at] = positions[sample, cols]
        packed["segment_ids"][row, at] = segment
        if routes is not None:
            routes[row, at] = routed_experts[sample, cols]
        return np.arange(width) + local_row * row_length + offset

    for m, (group_items, group_bins) in enumerate(zip(items, bins, strict=True)):
        for local_row, items_of_row in enumerate(group_bins):
            offset = 0
            for segment, k in enumerate(items_of_row, start=1):
                item = group_items[k]
                cells = place(local_row, m, offset, item.leader, slice(0, item.shared), segment)
                offset += item.shared
                for tail, i in enumerate(item.members, start=1):
                    gather[i, :item.shared] = cells
                    rest = int(lengths[i]) - item.shared
                    if rest:
                        gather[i, item.shared:lengths[i]] = place(local_row, m, offset, i,
                                                                  slice(item.shared, int(lengths[i])),
                                                                  tail_segment(segment, tail))
                        offset += rest
    return PackedRows(**packed, gather=gather, routed_experts=routes)
