"""Named tensors handed to a local SGLang server through shared memory (``PushConfig.method: tensor``).

SGLang's ``/update_weights_from_tensor`` takes, per tensor-parallel rank, a base64 string of a
``multiprocessing.reduction.ForkingPickler`` pickle of ``[(name, torch.Tensor), ...]``; a CPU
tensor pickles as the name of a shared-memory file holding its data (torch's ``file_system``
sharing strategy; the default ``file_descriptor`` one crashed SGLang's scheduler on CPU), so
only names and shapes travel over HTTP and the server copies the data straight into its
parameters. ``SharedTensors`` keeps the buffers (and so the files) from push to push, and hands
the tensors over in chunks, so the server loads one chunk while the next is copied.

Needs ``torch`` in the learner's environment (it is in jaxrl's pinned requirements) and the
server on the same host.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import warnings
from typing import Iterator

import numpy as np

from jaxrl.models.hf import TensorStream


class SharedTensors:
    """Shared-memory tensors, one per name, rewritten in place at every push.

    ``chunks(tensors, chunk_bytes)`` copies each host array of a ``TensorStream`` (contiguous or a
    strided view) into its buffer and yields the names of each chunk of consecutive tensors as soon
    as they are in place; ``payload(names)`` is what one receiver is given for them. Each payload
    may be opened once: torch counts a reference per pickle, which the receiver's unpickling
    takes, so one payload read by two servers (or by two tensor-parallel ranks) would drop a count
    that is not theirs, and the last of them to let go would delete the files this side still
    uses (the next push then fails to open them). Reusing the buffers matters for speed: fresh shared memory costs
    a page fault per page on first write (measured: about 0.4 s for 377 MiB here, against under
    0.1 s to rewrite warm buffers). The server copies the data into its parameters while it
    answers the request, so the buffers may be rewritten for the next push once it has answered;
    until then they hold the last pushed weights, which a restarted server is given again.

    A server that exits takes the names of the files it opened with it (torch's shared-memory
    manager of that process unlinks them), though the data stays mapped here: after a restart
    :meth:`renew` moves the data into new files.
    """

    def __init__(self):
        self._buffers: dict[str, object] = {}  # name -> shared torch tensor
        self._dtypes: dict[str, np.dtype] = {}  # name -> the host arrays' dtype

    def chunks(self, tensors: TensorStream, chunk_bytes: int) -> Iterator[tuple[list[str], bool]]:
        """``(names, is_last)`` per chunk: each chunk takes the tensors in order until it holds at
        least ``chunk_bytes``. Every buffer is made from ``tensors.specs`` before the first array is
        read, so a failure to allocate one leaves no server half-updated; each array is read from
        ``tensors.arrays`` when its chunk is copied (with several JAX processes, gathered then)."""
        torch = _torch()
        _release(self._allocate(torch, tensors.specs))
        groups = consecutive_groups(tensors.specs, chunk_bytes)
        arrays = iter(tensors.arrays)
        for i, names in enumerate(groups):
            for want in names:
                name, array = next(arrays)
                if name != want or tuple(array.shape) != tuple(self._buffers[name].shape):
                    raise ValueError(f"the tensor stream announced {want!r} {tuple(self._buffers[want].shape)} "
                                     f"but gave {name!r} {tuple(array.shape)}")
                _copy_into(torch, self._buffers[name], array)
            yield names, i == len(groups) - 1

    def close(self) -> None:
        """Releases the buffers."""
        _release(self._buffers)

    @property
    def nbytes(self) -> int:
        """Bytes in the buffers: what one push hands each server."""
        return sum(buffer.untyped_storage().nbytes() for buffer in self._buffers.values())

    def renew(self) -> list[str]:
        """The same data in new shared-memory files; returns every name (for :meth:`payload`)."""
        torch = _torch()
        old, self._buffers = self._buffers, {}
        for name in old:
            self._buffers[name] = _shared_tensor(torch, tuple(old[name].shape), self._dtypes[name])
            self._buffers[name].copy_(old[name])
        _release(old)
        return list(self._buffers)

    def _allocate(self, torch, specs) -> dict:
        """Makes a buffer for every name of ``specs`` that has none of its shape and dtype; returns
        the buffers replaced (no other reference to them is left here, for ``_release``)."""
        replaced = {}
        for name, (shape, dtype) in specs.items():
            if name not in self._buffers or tuple(self._buffers[name].shape) != shape or self._dtypes[name] != dtype:
                if name in self._buffers:
                    replaced[name] = self._buffers.pop(name)
                self._buffers[name] = _shared_tensor(torch, shape, dtype)
                self._dtypes[name] = dtype
        return replaced

    def payload(self, names: list[str]) -> str:
        """One receiver's handle on these tensors (names and shapes of their shared files, base64):
        give each server, and each tensor-parallel rank, its own (class doc)."""
        from multiprocessing.reduction import ForkingPickler

        stream = io.BytesIO()
        # torch.multiprocessing registered ForkingPickler's tensor reducers when imported.
        ForkingPickler(stream).dump([(name, self._buffers[name]) for name in names])
        return base64.b64encode(stream.getvalue()).decode()


def _release(buffers: dict) -> None:
    """Drops ``buffers`` (emptying the dict, which must hold the last references: a name left bound
    to one keeps it alive past the stand-in's removal below). A server that died
    took the names of the files it had opened with it (class doc), and torch unlinks a file by name
    when its last reference here goes: finding none, it aborts the whole process (a C++ exception in
    a destructor). So a file whose name is gone gets an empty stand-in under it first, which
    torch's unlink removes, or, where a reference elsewhere keeps the buffer alive, this does."""
    files = ["/dev/shm" + b.untyped_storage()._share_filename_cpu_()[1].decode() for b in buffers.values()]
    stand_ins = [path for path in files if not os.path.exists(path)]
    for path in stand_ins:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    buffers.clear()
    for path in stand_ins:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def consecutive_groups(specs: dict[str, tuple[tuple[int, ...], np.dtype]], chunk_bytes: int) -> list[list[str]]:
    groups, size = [[]], 0
    for name, (shape, dtype) in specs.items():
        if size >= chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return groups


def read_payload(payload: str) -> dict[str, np.ndarray]:
    """What a server reads from a ``SharedTensors`` payload, {name: array} (bfloat16 as ml_dtypes'),
    the shared files opened as the server opens them: to check what a push hands over."""
    import pickle

    import ml_dtypes

    torch = _torch()
    arrays = {}
    for name, tensor in pickle.loads(base64.b64decode(payload)):
        if tensor.dtype == torch.bfloat16:
            arrays[name] = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            arrays[name] = tensor.numpy()
    return arrays


def _torch():
    try:
        import torch
        import torch.multiprocessing as torch_mp
    except ImportError as err:  # pragma: no cover - torch is a pinned requirement
        raise ImportError("PushConfig.method=tensor needs torch in the learner's environment "
                          f"(pip install torch), or use method=disk: {err}") from None
    # Process-wide, and the only strategy the CPU server can open (module doc).
    torch_mp.set_sharing_strategy("file_system")
    return torch


def _shared_tensor(torch, shape: tuple[int, ...], dtype: np.dtype):
    """A new contiguous shared-memory tensor of this shape and numpy dtype (bfloat16, which
    ml_dtypes holds and torch cannot wrap, as torch's own)."""
    dtype = np.dtype(dtype)
    torch_dtype = torch.bfloat16 if dtype.name == "bfloat16" else torch.from_numpy(np.zeros(0, dtype)).dtype
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))  # in the file_system strategy's memory
    return torch.empty(0, dtype=torch_dtype).set_(storage, 0, shape)


def _copy_into(torch, tensor, array: np.ndarray) -> None:
    """One pass from ``array`` (any strides: transposed views of the parameters) into the buffer:
    torch's strided copy, on its threads, where numpy's copy of a transposed view is 2-4x slower."""
    if tensor.dtype == torch.bfloat16:  # through the bits
        tensor, array = tensor.view(torch.int16), array.view(np.int16)
    with warnings.catch_warnings():  # a read-only view of the learner's arrays; torch only reads it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        source = torch.from_numpy(array)
    tensor.copy_(source)
