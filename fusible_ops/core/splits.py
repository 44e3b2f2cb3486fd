"""Split sizes: validation and conversion to host lists and device offsets.

Split sizes arrive as a list of ints, a CPU integer tensor or a device integer tensor.
Values on the host are checked eagerly; values on an accelerator, and every tensor's
values while ``torch.compile``/``torch.export`` trace, are checked with
``torch._assert_async`` so that no host read enters the graph.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SplitInfo:
    """Split sizes of one call.

    ``host``: the sizes as a list (None when only on device or while tracing);
    ``offsets``: int32 ``[G]`` inclusive cumsum on the data's device; ``host_sizes``:
    the sizes as a CPU tensor when the data is elsewhere and the sizes were on the
    host (kernels behind custom ops read them there, not from the device).
    """

    host: list[int] | None
    offsets: torch.Tensor
    host_sizes: torch.Tensor | None = None


class _LastSplits:
    """The most recent CPU split-size tensor seen, its version and what was derived from it.

    One call hands the same tensor to fc1 and fc2 (and preflight checks it before either
    runs): its values are read once, not four times. Every fuser call reads them afresh
    (:func:`start_call`), because a write through a shared NumPy or DLPack view changes
    the values without bumping the version counter; within a call the version counter
    makes an in-place change a miss. What was derived from the values (which checks they
    passed, the offsets per device) is kept when a fresh read of the same tensor finds the
    same values. Never used while tracing.
    """

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None  # None: read afresh
        self.read_from: torch.Tensor | None = None  # the tensor ``values`` were last read from
        self.version = -1
        self.values: list[int] = []
        self.checked: set[tuple[int, int]] = set()
        self.infos: dict[torch.device | str, SplitInfo] = {}

    def values_of(self, tensor: torch.Tensor) -> list[int]:
        # inference tensors track no version: never reuse what was read from one
        version = None if tensor.is_inference() else tensor._version
        if tensor is not self.tensor or version is None or version != self.version:
            values = tensor.tolist()  # an integer tensor: Python ints
            if tensor is not self.read_from or values != self.values:
                # the infos hold the tensor itself (``host_sizes``): only its own equal values keep them
                self.values, self.checked, self.infos = values, set(), {}
            self.tensor, self.read_from, self.version = tensor, tensor, version
        return self.values


class _ThreadSplits(threading.local):
    def __init__(self) -> None:
        self.value = _LastSplits()


_last = _ThreadSplits()


def _last_splits() -> _LastSplits:
    return _last.value


def start_call() -> None:
    """Forget the split sizes read by earlier calls (see :class:`_LastSplits`).

    Traced calls never read that eager cache, and leave it alone (a side effect Dynamo
    refuses inside a checkpointed region)."""
    if not torch.compiler.is_compiling():
        forget_split_reads()


def forget_split_reads() -> None:
    """:func:`start_call` for a caller that knows it is not tracing."""
    _last.value.tensor = None


def read_host_splits(split_sizes: torch.Tensor) -> list[int]:
    """The values of a CPU split-size tensor, read once per call (see :class:`_LastSplits`);
    eager only."""
    return _last.value.values_of(split_sizes)


def check_split_sizes(op_name: str, split_sizes: Any, num_groups: int, num_rows: int) -> None:
    """Raise ``ValueError`` when ``split_sizes`` is unusable (host values checked eagerly)."""
    if isinstance(split_sizes, torch.Tensor):
        on_host = split_sizes.is_cpu and not torch.compiler.is_compiling()
        if on_host:
            last = _last_splits()
            if split_sizes is last.tensor and (num_groups, num_rows) in last.checked:
                return  # checked in this call already (nothing runs between an op's checks)
        if (
            split_sizes.dtype.is_floating_point
            or split_sizes.dtype.is_complex
            or split_sizes.dtype == torch.bool
        ):
            raise ValueError(
                f"{op_name}: split_sizes must be an integer tensor, got dtype {split_sizes.dtype}"
            )
        if split_sizes.dim() != 1 or split_sizes.numel() != num_groups:
            raise ValueError(
                f"{op_name}: split_sizes must be 1-D of length {num_groups} (one per group), "
                f"got shape {tuple(split_sizes.shape)}"
            )
        if not on_host:
            return  # values are checked on device (asynchronously) or in the graph, in to_split_info
        values = last.values_of(split_sizes)
        if (num_groups, num_rows) in last.checked:
            return
        check_split_values(op_name, values, num_rows)
        last.checked.add((num_groups, num_rows))
        return
    elif isinstance(split_sizes, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in split_sizes):
            raise ValueError(f"{op_name}: split_sizes must hold ints, got {list(split_sizes)!r}")
        if len(split_sizes) != num_groups:
            raise ValueError(
                f"{op_name}: split_sizes has length {len(split_sizes)}; expected {num_groups} (one per group)"
            )
        values = list(split_sizes)
        check_split_values(op_name, values, num_rows)
    else:
        raise ValueError(
            f"{op_name}: split_sizes must be a 1-D integer tensor or a list of ints, got {type(split_sizes).__name__}"
        )


def check_split_values(op_name: str, values: list[int], num_rows: int) -> None:
    """Raise ``ValueError`` unless host split sizes are non-negative and sum to ``num_rows``."""
    if values and min(values) < 0:
        raise ValueError(f"{op_name}: split_sizes must be non-negative, got {values}")
    if sum(values) != num_rows:
        raise ValueError(f"{op_name}: split_sizes sum to {sum(values)} but the input has {num_rows} rows")


_HOST_OFFSETS: dict[tuple[int, ...], torch.Tensor] = {}


def host_offsets(host: list[int]) -> torch.Tensor:
    """int32 inclusive cumsum ``[G]`` of host sizes on the CPU, shared between calls with the
    same sizes (``torch.tensor`` or ``torch.cumsum`` cost 10-20 us, a large part of a tiny
    call). Nothing writes offsets; a bounded number of distinct sizes is kept."""
    key = tuple(host)
    offsets = _HOST_OFFSETS.get(key)
    if offsets is None:
        cumulative, total = [], 0
        for v in host:
            total += v
            cumulative.append(total)
        # a normal tensor even when first made under inference mode: later calls save it for backward
        with torch.inference_mode(False):
            offsets = torch.tensor(cumulative, dtype=torch.int32)
        if len(_HOST_OFFSETS) >= 256:
            _HOST_OFFSETS.clear()
        _HOST_OFFSETS[key] = offsets
    return offsets


def host_split_info(split_sizes: torch.Tensor, rows: torch.Tensor) -> SplitInfo:
    """:func:`to_split_info` of a CPU split-size tensor in an eager call (not while tracing)."""
    last = _last.value
    host = last.values_of(split_sizes)
    on_cpu = rows.is_cpu  # not rows.device: building a device object is a large part of a tiny call
    device_key = "cpu" if on_cpu else rows.device
    info = last.infos.get(device_key)
    if info is None:
        offsets = host_offsets(host)
        if not on_cpu:
            offsets = offsets.to(rows.device, non_blocking=True)
        info = SplitInfo(host, offsets, None if on_cpu else split_sizes)
        last.infos[device_key] = info
    return info


def to_split_info(split_sizes: Any, num_rows: int, rows: torch.Tensor) -> SplitInfo:
    """Host list (when free to get) and int32 offsets on ``rows``' device, without a host sync."""
    tracing = torch.compiler.is_compiling()
    on_cpu = rows.is_cpu  # not rows.device: building a device object is a large part of a tiny call
    if isinstance(split_sizes, torch.Tensor):
        if split_sizes.is_cpu and not tracing:
            return host_split_info(split_sizes, rows)
        ok = (split_sizes >= 0).all() & (split_sizes.sum() == num_rows)
        torch._assert_async(ok, "split_sizes must be non-negative and sum to the number of input rows")
        offsets = torch.cumsum(split_sizes, 0, dtype=torch.int32).to(rows.device)
        on_host = split_sizes.is_cpu and not on_cpu
        return SplitInfo(None, offsets, split_sizes if on_host else None)
    if tracing:
        offsets = torch.tensor(list(split_sizes), dtype=torch.int64).cumsum(0).to(torch.int32)
        return SplitInfo(None, offsets.to(rows.device), None)
    host = [int(v) for v in split_sizes]
    offsets = host_offsets(host)
    if not on_cpu:
        offsets = offsets.to(rows.device, non_blocking=True)
    return SplitInfo(host, offsets)
