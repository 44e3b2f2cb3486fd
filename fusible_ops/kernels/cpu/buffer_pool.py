"""Reuse of large CPU output buffers once every tensor using them is gone.

PyTorch's CPU allocator hands large blocks (over glibc's mmap threshold, at most
32 MB) back to the OS when they are freed, so the next step's tensor of the same size
is page-faulted again on first write, 4 KiB at a time. For the grouped MLP's
``[tokens, 2 * ffn]`` outputs that costs more than the activation math itself.

:class:`CpuBufferPool` keeps the storages it handed out and gives one back only when
the C++ use count of that storage shows that no tensor, view, saved-for-backward
tensor, NumPy array or DLPack capsule refers to it any more, and the storage is still
the private memory it was: not moved to shared memory (``share_memory_()``, which is
what sending a tensor through a ``torch.multiprocessing`` queue does; another process
may map it with no reference here) and neither resized nor reallocated. Anything
else is never handed out again, so a caller can never see its data change under it.
Each handed-out tensor is a fresh tensor object over the storage (not a view), so
autograd's view tracking is not involved.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


def _storage_use_count(storage: torch.UntypedStorage) -> int | None:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # private API; without it nothing is ever reused
        return None
    return int(use_count(storage._cdata))


class CpuBufferPool:
    """A bounded set of reusable CPU storages, keyed by ``(shape, dtype)``.

    ``min_bytes``: smaller requests are plain ``torch.empty`` (the allocator reuses
    those itself). ``max_buffers``: most storages kept; least recently used free ones
    are dropped first, and when every kept storage is in use the request is a plain
    allocation.
    """

    def __init__(self, *, min_bytes: int = 1 << 20, max_buffers: int = 16) -> None:
        self.min_bytes = min_bytes
        self.max_buffers = max_buffers
        #: id -> (shape, dtype, storage, (data pointer, bytes) when handed out)
        self._storages: OrderedDict[
            int, tuple[tuple[int, ...], torch.dtype, torch.UntypedStorage, tuple[int, int]]
        ] = OrderedDict()
        self._next_id = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape``, reusing a free storage when one fits."""
        shape = tuple(int(s) for s in shape)
        device = torch.device(device)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if device.type != "cpu" or nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            self._drop_escaped()
            for key, (kept_shape, kept_dtype, storage, _) in self._storages.items():
                if kept_shape == shape and kept_dtype == dtype and _storage_use_count(storage) == 1:
                    self._storages.move_to_end(key)
                    return self._tensor_over(storage, shape, dtype)
            tensor = torch.empty(shape, dtype=dtype, device=device)
            storage = tensor.untyped_storage()
            if _storage_use_count(storage) is None:
                return tensor
            self._evict_one_free()
            if len(self._storages) < self.max_buffers:
                self._storages[self._next_id] = (
                    shape,
                    dtype,
                    storage,
                    (storage.data_ptr(), storage.nbytes()),
                )
                self._next_id += 1
            return tensor

    def clear(self) -> None:
        """Drop every kept storage (memory in use by callers stays valid)."""
        with self._lock:
            self._storages.clear()

    def kept_bytes(self) -> int:
        """Bytes of storage currently kept by the pool (in use or free)."""
        with self._lock:
            return sum(storage.nbytes() for _, _, storage, _ in self._storages.values())

    def _drop_escaped(self) -> None:
        """Forget storages that are no longer provably private (never handed out again)."""
        escaped = [
            key
            for key, (_, _, storage, identity) in self._storages.items()
            if storage.is_shared() or (storage.data_ptr(), storage.nbytes()) != identity
        ]
        for key in escaped:
            del self._storages[key]

    def _evict_one_free(self) -> None:
        if len(self._storages) < self.max_buffers:
            return
        for key, (_, _, storage, _) in self._storages.items():  # least recently used first
            if _storage_use_count(storage) == 1:
                del self._storages[key]
                return

    @staticmethod
    def _tensor_over(
        storage: torch.UntypedStorage, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        strides = []
        step = 1
        for size in reversed(shape):
            strides.append(step)
            step *= max(size, 1)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, tuple(reversed(strides)))
