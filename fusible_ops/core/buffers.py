"""Caller-provided buffers: the keys ops accept and the single validation routine.

A buffer is checked before any computation. Its leading (token) dim may be longer
than the rows produced; the padded tail is never written. On success the op writes
into the buffer and returns a view of its first rows.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterable, Sequence

import torch
import torch.fx.node

OUTPUT_BUFFER_KEY = "output"
GRAD_INPUT_BUFFER_KEY = "grad_input"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if type(t).__name__ == "DTensor" else t


def _memory_span(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` intersect (conservative for strided views).

    A DTensor is compared by its local shard (the memory this process holds).
    """
    a, b = _local(a), _local(b)
    if a.device != b.device:
        return False
    span_a, span_b = _memory_span(a), _memory_span(b)
    if span_a is None or span_b is None:
        return False
    return span_a[0] < span_b[1] and span_b[0] < span_a[1]


def _check_dense(where: str, buffer: torch.Tensor) -> None:
    """A buffer is written in place through its memory: sparse and nested tensors have none
    to write into (``ValueError``)."""
    if buffer.layout != torch.strided or buffer.is_nested:
        layout = "nested" if buffer.is_nested else str(buffer.layout)
        raise ValueError(f"{where} must be a dense (strided) tensor, got layout {layout}")


def validate_or_alloc_output(
    buffer: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    op_name: str = "op",
    key: str = OUTPUT_BUFFER_KEY,
    no_overlap: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Return a tensor of ``shape`` to write into: a fresh one, or a view of ``buffer``.

    Args:
        buffer: the caller's buffer, or None to allocate. Its leading dim may be longer
            than ``shape[0]`` (a padded tail, never written); every other dim must match.
        shape: the result's shape, ``[rows, *features]``.
        dtype: the op's compute dtype; the buffer must have it.
        device: the buffer must be on it.
        op_name: the op named in error messages.
        key: the ``op_kwargs`` key named in error messages.
        no_overlap: tensors the buffer must not share memory with (the op's inputs and
            parameters).

    Returns:
        A fresh tensor of ``shape``, or ``buffer[:shape[0]]`` (same memory as ``buffer``).

    Raises:
        ValueError: naming ``op_name`` and ``key``: a buffer that is not a dense tensor, of
            the wrong shape, dtype or device, not contiguous, requiring grad, made under
            ``torch.inference_mode``, or overlapping a tensor of ``no_overlap``.
    """
    shape = tuple(int(s) for s in shape)
    device = torch.device(device)
    if buffer is None:
        return torch.empty(shape, dtype=dtype, device=device)

    where = f"{op_name}: buffer {key!r}"
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(buffer).__name__}")
    _check_dense(where, buffer)
    if buffer.dim() != len(shape) or tuple(buffer.shape[1:]) != shape[1:]:
        raise ValueError(
            f"{where} has shape {tuple(buffer.shape)}; expected [>= {shape[0]}, "
            f"{', '.join(str(s) for s in shape[1:])}] (trailing dims must match exactly)"
        )
    if buffer.shape[0] < shape[0]:
        raise ValueError(f"{where} has {buffer.shape[0]} rows; at least {shape[0]} are needed")
    if buffer.dtype != dtype:
        raise ValueError(f"{where} has dtype {buffer.dtype}; expected {dtype} (the op's compute dtype)")
    if buffer.device != device:
        raise ValueError(f"{where} is on {buffer.device}; expected {device}")
    if not buffer.is_contiguous():
        raise ValueError(f"{where} must be contiguous (got strides {buffer.stride()})")
    if buffer.requires_grad:
        raise ValueError(f"{where} must not require grad; pass buf.detach()")
    tracing = torch.compiler.is_compiling()
    if not tracing and buffer.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{where} was created under torch.inference_mode and cannot be written outside it; "
            "allocate it outside inference_mode (or pass buf.clone())"
        )
    # Data pointers do not exist while tracing; compiled graphs are functionalized, so
    # a mutated buffer that aliases an input is written after every read of it.
    checked = () if tracing else no_overlap
    for other in checked:
        if isinstance(other, torch.Tensor) and tensors_overlap(buffer, other):
            raise ValueError(
                f"{where} overlaps the memory of one of the op's inputs or parameters "
                f"(shape {tuple(other.shape)}); use a separate buffer"
            )
    # Always a new view, never ``buffer`` itself: an autograd Function returning it would
    # attach its grad_fn to the caller's tensor, which then fails the requires_grad check
    # when the buffer is reused in the next iteration.
    return buffer[: shape[0]]


def validate_or_alloc_rows(
    buffer: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    op_name: str = "op",
    key: str = OUTPUT_BUFFER_KEY,
    no_overlap: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """:func:`validate_or_alloc_output` for a result of ``shape`` ``[*token_dims, features]``.

    Besides a buffer shaped like the result, a 2-D buffer ``[>= rows, features]`` is
    accepted for an N-D result (the token dims flattened); the return has ``shape``.
    """
    shape = tuple(int(s) for s in shape)
    if buffer is not None and isinstance(buffer, torch.Tensor) and buffer.dim() == 2 and len(shape) != 2:
        rows = 1
        for s in shape[:-1]:
            rows *= s
        flat = validate_or_alloc_output(
            buffer, (rows, shape[-1]), dtype, device, op_name=op_name, key=key, no_overlap=no_overlap
        )
        return flat.view(shape)
    return validate_or_alloc_output(
        buffer, shape, dtype, device, op_name=op_name, key=key, no_overlap=no_overlap
    )


def call_buffers(
    ops: Sequence[object], kwargs: Sequence[dict | None], positions: Sequence[int]
) -> list[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` for every caller buffer among the ops' kwargs of one call;
    ``positions``: each op's index in its Sequential (or fuser), named in the label."""
    found = []
    for op, op_kwargs, position in zip(ops, kwargs, positions):
        for key in getattr(op, "buffer_kwargs", ()):
            buffer = (op_kwargs or {}).get(key)
            if isinstance(buffer, torch.Tensor):
                found.append((f"{op.op_name()}: buffer {key!r} (op {position})", buffer))
    return found


def check_call_buffers(buffers: Sequence[tuple[str, torch.Tensor]], guard: Iterable[torch.Tensor]) -> None:
    """Refuse a call whose caller buffers overlap each other or any ``guard`` tensor.

    One call is one forward and its backward: two buffers sharing memory would make one
    op's result overwrite another's (or the forward output be overwritten by a gradient),
    and a buffer overlapping an input, extra input or parameter would corrupt what the
    call reads. ``guard``: every such tensor of the whole call (all groups of a
    Sequential). While tracing the same check runs as the custom op
    ``fusible_ops::check_call_buffers`` (see :func:`_traced_check`).
    """
    if not buffers:
        return
    for label, buffer in buffers:
        _check_dense(label, buffer)
    guard = [t for t in guard if isinstance(t, torch.Tensor)]
    if torch.compiler.is_compiling():
        _traced_check(buffers, guard)
        return
    _check_overlaps(buffers, guard, tensors_overlap)


def _check_overlaps(
    buffers: Sequence[tuple[str, torch.Tensor]], guard: Sequence[torch.Tensor], overlap
) -> None:
    for i, (label, buffer) in enumerate(buffers):
        for other_label, other in buffers[:i]:
            if overlap(buffer, other):
                raise ValueError(
                    f"{label} overlaps {other_label}: every buffer of a call must be its own memory "
                    "(one result or gradient would overwrite the other); use separate buffers"
                )
        for tensor in guard:
            if overlap(buffer, tensor):
                raise ValueError(
                    f"{label} overlaps the memory of an input, extra input, parameter or module "
                    f"buffer of the call (shape {tuple(tensor.shape)}); use a separate buffer"
                )


def _storage_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """:func:`tensors_overlap` from storages and offsets: also for fake tensors (which share
    a fake storage exactly where the real inputs share memory), which have no data pointers."""
    from torch.multiprocessing.reductions import StorageWeakRef

    a, b = _local(a), _local(b)
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return False
    spans = []
    for t in (a, b):
        extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
        start = t.storage_offset() * t.element_size()
        spans.append((start, start + extent * t.element_size()))
    return spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]


def _traced_check(buffers: Sequence[tuple[str, torch.Tensor]], guard: Sequence[torch.Tensor]) -> None:
    """The overlap check inside a compiled graph, as a side-effecting custom op: its fake
    implementation runs while the graph is traced (fake tensors share storage where the
    inputs do), so aliasing present when compiling is refused before a graph exists; its
    real implementation runs in the graph, before the mutations of the caller's buffers
    that AOTAutograd applies after the graph's computations (``aot_eager``; Inductor may
    drop an op without outputs, leaving the trace-time check)."""
    _CHECK_OP([t for _, t in buffers], list(guard), [label for label, _ in buffers])


def _check_op_impl(buffers: list[torch.Tensor], guard: list[torch.Tensor], labels: list[str]) -> None:
    _check_overlaps(list(zip(labels, buffers)), guard, _storage_overlap)


# defined at import (a few microseconds): Dynamo cannot trace the definition
_LIBRARY = torch.library.Library("fusible_ops", "FRAGMENT")
_LIBRARY.define("check_call_buffers(Tensor[] buffers, Tensor[] guard, str[] labels) -> ()")
_LIBRARY.impl("check_call_buffers", _check_op_impl, "CompositeExplicitAutograd")
torch.library.register_fake("fusible_ops::check_call_buffers", _check_op_impl, lib=_LIBRARY)
_CHECK_OP = torch.ops.fusible_ops.check_call_buffers.default
torch.fx.node.has_side_effect(_CHECK_OP)  # kept in the graph although it returns nothing


def buffer_rows(buffer: torch.Tensor | None, num_rows: int, features: int) -> torch.Tensor | None:
    """The first ``num_rows`` rows of an already validated buffer, as ``[num_rows, features]``.

    For ops that checked their buffers in ``preflight``: the compute path only slices.
    """
    return None if buffer is None else buffer.view(-1, features)[:num_rows]


class GradBufferWrites:
    """Which calls' backwards wrote which grad_input buffer memory, and when.

    A call whose grad_input buffer was written by *another* call's backward after this
    call's forward must not write it again: that would overwrite a gradient already
    handed to autograd (a leaf's ``.grad`` keeps the buffer itself). Memory spans are
    compared, not version counters: views of one workspace share a version counter,
    so disjoint buffers carved from it would look written. Only addresses are kept
    (no reference to the memory), for the most recent ``max_writes`` writes.
    """

    def __init__(self, max_writes: int = 4096) -> None:
        self._clock = itertools.count()
        self._writes: deque[tuple[torch.device, int, int, int, int]] = deque(maxlen=max_writes)
        self._lock = threading.Lock()

    def now(self) -> int:
        """A timestamp, later than every earlier one."""
        return next(self._clock)

    def written_by_other_since(self, buffer: torch.Tensor, since: int, call_id: int) -> bool:
        span = _memory_span(_local(buffer))
        if span is None:
            return False
        with self._lock:
            # newest first; writes are appended in time order, so stop at this call's forward
            for device, start, end, stamp, owner in reversed(self._writes):
                if stamp <= since:
                    return False
                if owner != call_id and device == buffer.device and start < span[1] and span[0] < end:
                    return True
        return False

    def record(self, buffer: torch.Tensor, call_id: int) -> None:
        span = _memory_span(_local(buffer))
        if span is not None:
            with self._lock:
                self._writes.append((buffer.device, span[0], span[1], self.now(), call_id))


#: the process-wide record the fuser consults
GRAD_BUFFER_WRITES = GradBufferWrites()
