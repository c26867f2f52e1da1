"""Host data in and out of global arrays, and host work split over processes.

Host data reaches a sharded ``jit`` in one of two ways (plain numpy inputs
are refused there): every process holds the same value and places it with
``jax.device_put(x, sharding)`` (the trainer does this: every process reads
the same global batch), or each process holds only its own rows
(:func:`process_rows`) and :func:`global_batch` assembles them. Results come
back with :func:`to_host` (``np.asarray`` fails on an array spread over
several processes). Host work split over processes (SGLang rollouts: each
process drives its own servers) takes :func:`process_share` of the items, and
:func:`allgather_ragged` gives every process the whole result in item order.
Logs and plots come from process 0 (:func:`is_main_process`,
:func:`main_process_only`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np


def process_rows(sharding: jax.sharding.Sharding, global_shape: Sequence[int]) -> np.ndarray:
    """Indices of the rows (axis 0) of a global array of ``global_shape`` this process must supply.

    Sorted, as :func:`jax.make_array_from_process_local_data` expects the
    process-local array to hold them. Processes whose devices are replicas
    along axis 0 get the same rows.
    """
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows.update(range(*index[0].indices(global_shape[0])))
    return np.array(sorted(rows), dtype=np.int64)


def global_batch(shardings: Any, local_batch: Any, global_batch_size: int) -> Any:
    """Assembles global arrays from each process's rows (a pytree of numpy arrays).

    ``shardings``: one ``jax.sharding.Sharding`` for every leaf, or a matching
    tree (a prefix). Every leaf has the batch on axis 0; its local rows are the
    ones :func:`process_rows` names, in that order.
    """
    leaves, treedef = jax.tree.flatten(local_batch)
    sharding_leaves = (
        [shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding)
        else treedef.flatten_up_to(shardings)
    )
    arrays = []
    for leaf, sharding in zip(leaves, sharding_leaves, strict=True):
        leaf = np.asarray(leaf)
        global_shape = (global_batch_size,) + leaf.shape[1:]
        expected = len(process_rows(sharding, global_shape))
        if leaf.shape[0] != expected:
            raise ValueError(
                f"process {jax.process_index()} supplied {leaf.shape[0]} rows of a global batch of "
                f"{global_batch_size}, but its devices hold {expected} rows under {sharding}; feed the rows "
                f"process_rows() names (global batch size / number of data-parallel processes)"
            )
        arrays.append(jax.make_array_from_process_local_data(sharding, leaf, global_shape))
    return treedef.unflatten(arrays)


def to_host(tree: Any) -> Any:
    """The full value of every array in ``tree`` as numpy, on every process.

    ``np.asarray`` works only on arrays this process holds entirely (or fully
    replicated ones); a global array sharded over several processes is
    gathered from all of them (a collective: every process must call this).
    """
    from jax.experimental import multihost_utils  # noqa: PLC0415

    def fetch(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(fetch, tree)


def gather_to_hosts(x: jax.Array) -> np.ndarray:
    """The full value of ``x`` on every process, each receiving only the parts it lacks, once.

    :func:`to_host` replicates the array on every device of its mesh, so a host with 8 devices
    receives every other host's part 8 times. Here each process reads its own shards locally and
    the others' arrive over a mesh of one device per process: a host receives (hosts - 1) / hosts
    of the array, the least a copy on every host can cost. A part several processes hold is sent by
    the lowest of them. A collective: every process calls it for the same arrays in the same order.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    shape, count, me = tuple(x.shape), jax.process_count(), jax.process_index()
    owners: dict[tuple, int] = {}  # each distinct part (as slices' bounds) -> the lowest process holding it
    for device, index in sorted(x.sharding.devices_indices_map(shape).items(), key=lambda d: d[0].process_index):
        owners.setdefault(_bounds(index, shape), device.process_index)
    parts = [[key for key, owner in owners.items() if owner == p] for p in range(count)]
    sizes = [sum(math.prod(b - a for a, b in key) for key in keys) for keys in parts]
    held = {_bounds(shard.index, shape): shard.data for shard in x.addressable_shards}
    flat = np.zeros(max(max(sizes), 1), x.dtype)
    flat[:sizes[me]] = np.concatenate([np.asarray(held[key]).ravel() for key in parts[me]] or [flat[:0]])
    mine = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(count)]
    mesh = jax.sharding.Mesh(np.asarray(mine), ("hosts",))
    spread = jax.make_array_from_single_device_arrays(
        (count, flat.size), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("hosts")),
        [jax.device_put(flat[None], mine[me])])
    everyone = np.asarray(_replicate(mesh)(spread).addressable_data(0))
    full = np.empty(shape, x.dtype)
    for p, keys in enumerate(parts):
        offset = 0
        for key in keys:
            size = math.prod(b - a for a, b in key)
            full[tuple(slice(a, b) for a, b in key)] = everyone[p, offset:offset + size].reshape(
                [b - a for a, b in key])
            offset += size
    return full


def _bounds(index: tuple, shape: tuple) -> tuple:
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=True))


@functools.cache
def _replicate(mesh: jax.sharding.Mesh):
    return jax.jit(lambda a: a, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def is_main_process() -> bool:
    """True on process 0, the one that writes logs, TensorBoard events and plots."""
    return jax.process_index() == 0


def main_process_only(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: runs ``function`` on process 0 only; elsewhere the call returns None."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs) if is_main_process() else None

    return wrapper


def process_share(num_items: int, process_index: int | None = None, process_count: int | None = None) -> slice:
    """The contiguous slice of ``num_items`` items that process ``process_index`` handles.

    Items are split in process order, the first ``num_items % process_count``
    processes taking one more (as ``np.array_split``), so the slices in process
    order concatenate to ``range(num_items)``; a process may get none.
    """
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if not 0 <= index < count:
        raise ValueError(f"process_share: process_index={index} is outside 0..{count - 1} (process_count={count})")
    base, extra = divmod(num_items, count)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


def allgather_ragged(arrays: Sequence[np.ndarray], dtype: Any, trailing_shape: Sequence[int] = ()) -> list[np.ndarray]:
    """Every process's ``arrays`` concatenated in process order, on every process (a collective).

    ``arrays``: this process's arrays of ``dtype``, each ``[length_k, *trailing_shape]``
    with any ``length_k`` (ragged), any number of them (none too). They travel as
    bytes padded to the longest process's total, so any dtype comes back bit for
    bit (``process_allgather`` alone would turn int64/float64 into 32 bits
    unless x64 is on). With one process the arrays come back as given. Every
    process must call this with the same ``dtype`` and ``trailing_shape``.
    """
    dtype, trailing_shape = np.dtype(dtype), tuple(int(d) for d in trailing_shape)
    local = [np.asarray(a) for a in arrays]
    for k, array in enumerate(local):
        if array.dtype != dtype or array.ndim < 1 or array.shape[1:] != trailing_shape:
            raise ValueError(
                f"allgather_ragged: array {k} of process {jax.process_index()} is {array.dtype}{list(array.shape)}; "
                f"expected {dtype}[length, {', '.join(map(str, trailing_shape))}] like every other array")
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils  # noqa: PLC0415

    def gather(x: np.ndarray) -> np.ndarray:  # [P, *x.shape]
        return np.asarray(multihost_utils.process_allgather(x, tiled=False))

    counts = gather(np.asarray([len(local)], np.int32))[:, 0]
    lengths = np.full(int(counts.max()), -1, np.int32)
    lengths[:len(local)] = [a.shape[0] for a in local]
    all_lengths = gather(lengths)
    row_bytes = dtype.itemsize * math.prod(trailing_shape)
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in local)
    size = int(all_lengths.clip(min=0).sum(axis=1).max()) * row_bytes
    padded = np.zeros(max(size, 1), np.uint8)
    padded[:len(payload)] = np.frombuffer(payload, np.uint8)
    all_bytes = gather(padded)
    result = []
    for process, count in enumerate(counts):
        offset = 0
        for length in all_lengths[process, :count]:
            chunk = all_bytes[process, offset:offset + length * row_bytes]
            result.append(chunk.view(dtype).reshape((int(length), *trailing_shape)).copy())
            offset += length * row_bytes
    return result
