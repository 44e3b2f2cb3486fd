"""Inductor lowers the ``cpu`` backend's fused grouped-MLP ops to the math they compute.

Under ``torch.compile`` the fused expert block is one ``fusible_ops::grouped_mlp_forward``
(and ``grouped_mlp_backward``) op. On CPU its implementation is the eager Python kernel
path, which Inductor can only call: at ``bench --small``'s shape that ran at about twice
the compiled ``torch._grouped_mm`` composition. So for the ``cpu`` backend the two
functional ops get an Inductor decomposition: the same computation written with
``torch._grouped_mm`` on the device offsets (no host values, nothing in place) and the
activation's reference math, which Inductor fuses into generated loops. The offsets end
at the row count (the ops assert it while tracing, see :func:`~fusible_ops.core.splits.to_split_info`).

Only Inductor (and ``aot_eager_decomp_partition``) use this table. ``aot_eager``,
``torch.export`` and dispatch modes (selective activation checkpointing) still see the
opaque op, and so does Inductor for a call the decomposition declines:

- another backend (``torch_loop``, ``triton``, ``cudnn``, forced ``grouped_mm``);
- a tensor off the CPU, a dtype ``torch._grouped_mm``'s meta function does not take
  (torch 2.13 traces it in bf16 only), or feature sizes it cannot align (not multiples
  of 16 bytes);
- the ``_out`` variants (a caller buffer): they keep writing the buffer in place.

Registration is lazy: importing fusible_ops does not import Inductor. The ops' fake
implementations, which run while Dynamo traces, call :func:`register_for_tracing`
(Inductor's torch 2.13 internals: ``decomposition.decompositions`` and
``lowering.make_fallback``). The functional ops carry :data:`LOWERING_ID`, a digest of the
sources the decomposition is made from, so that PyTorch's on-disk compile caches, keyed
on the traced graph, never reuse a graph lowered from other sources.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path

import torch

from .activation import ActivationSpec, activation_backward, activation_forward, row_dot
from .base import group_ids_from_offsets
from .cpu.backend import _dgrad_operand
from .pytorch.grouped_mm import _SUPPORTED_DTYPES, TorchGroupedMMBackend, _aligned_2d, _dense

Tensor = torch.Tensor

#: backends whose grouped-MLP ops Inductor may lower (the CPU backend's small-problem
#: path is already one ``torch._grouped_mm`` per GEMM; the decomposition lets Inductor
#: fuse the activation and scale around them)
LOWERED_BACKENDS = ("cpu",)

_registered = False


def _lowering_fingerprint() -> str:
    """A digest of the sources Inductor's decomposition of the fused ops is made from.

    Passed to those ops as ``lowering``, it becomes part of the traced graph, which
    PyTorch's on-disk compile caches key on: a changed decomposition is compiled afresh
    instead of reusing a graph lowered by the old one.
    """
    digest = hashlib.sha256()
    sources = (
        "inductor_lowering.py",
        "activation.py",
        "base.py",
        "cpu/backend.py",
        "pytorch/grouped_mm.py",
        "library.py",
    )
    for name in sources:
        try:
            digest.update((Path(__file__).parent / name).read_bytes())
        except OSError:  # sources not on disk (a zipped install): their names must do
            digest.update(name.encode())
    return digest.hexdigest()[:16]


#: see :func:`_lowering_fingerprint`
LOWERING_ID = _lowering_fingerprint()


def lowerable(backend: str, *tensors: Tensor | None) -> bool:
    """Whether this call's tensors allow the decomposition (else the opaque op runs)."""
    if backend not in LOWERED_BACKENDS or not hasattr(torch, "_grouped_mm"):
        return False
    x = tensors[0]
    if x.dim() != 2 or x.dtype not in _SUPPORTED_DTYPES or not _traceable(x.dtype):
        return False
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            return False
    for weight in tensors[1:3]:
        if TorchGroupedMMBackend.shape_problem(weight.shape[2], weight.shape[1], x.dtype) is not None:
            return False
    return True


@functools.cache
def _traceable(dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm``'s meta function takes ``dtype`` (torch 2.13: bf16 only,
    although the CPU kernel also runs fp16 and fp32)."""
    # called while tracing: probe outside the tracer's dispatch modes
    with torch.utils._python_dispatch._disable_current_modes():
        try:
            a = torch.empty(16, 16, dtype=dtype, device="meta")
            b = torch.empty(2, 16, 16, dtype=dtype, device="meta")
            offsets = torch.empty(2, dtype=torch.int32, device="meta")
            torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)
        except (RuntimeError, NotImplementedError, TypeError):
            return False
    return True


def _group_ids(offsets: Tensor, rows: int, groups: int) -> Tensor:
    """Each row's group (rows past the last offset clamped to the last group)."""
    return group_ids_from_offsets(offsets, rows).clamp(max=groups - 1)


def _row_bias(bias: Tensor, offsets: Tensor, rows: int) -> Tensor:
    return bias.index_select(0, _group_ids(offsets, rows, bias.shape[0]))


def _gemm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    return torch._grouped_mm(_aligned_2d(a), b, offs=offsets.to(torch.int32))


def _wgrad(grad_out: Tensor, x: Tensor, offsets: Tensor) -> Tensor:
    """``[G, N, K]`` per-group ``grad_out.T @ x``, zeros for empty groups."""
    result = torch._grouped_mm(_aligned_2d(grad_out).t(), _aligned_2d(x), offs=offsets.to(torch.int32))
    ends = offsets.long()
    empty = torch.diff(ends, prepend=ends.new_zeros(1)) == 0
    return torch.where(empty.view(-1, 1, 1), 0, result)


def _wgrad_like(weight: Tensor, grad_out: Tensor, x: Tensor, offsets: Tensor) -> Tensor:
    """Laid out like ``weight`` (see ``library._wgrad_like``)."""
    from .library import _k_major  # library imports this module

    if _k_major(weight):
        return _wgrad(x, grad_out, offsets).transpose(-2, -1)
    return _wgrad(grad_out, x, offsets)


def _bias_grad(grad_out: Tensor, offsets: Tensor, groups: int) -> Tensor:
    acc_dtype = torch.promote_types(grad_out.dtype, torch.float32)
    acc = grad_out.new_zeros(groups, grad_out.shape[1], dtype=acc_dtype)
    ids = _group_ids(offsets, grad_out.shape[0], groups)
    return torch.index_add(acc, 0, ids, grad_out.to(acc_dtype)).to(grad_out.dtype)


def _mlp_forward(x, w1, b1, w2, b2, scales, offsets, host_sizes, backend, *flags, lowering=""):
    if not lowerable(backend, x, w1, w2):
        return NotImplemented
    from .library import _spec

    *spec_args, scale_after_fc2 = flags
    return mlp_forward_math(x, w1, b1, w2, b2, scales, offsets, _spec(*spec_args), scale_after_fc2)


def _mlp_backward(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, backend, *rest, lowering=""):
    if not lowerable(backend, dy, w1, w2, x, pre):
        return NotImplemented
    from .library import _spec

    *spec_args, scale_after_fc2, needs = rest
    return mlp_backward_math(
        dy, x, pre, w1, w2, b2, scales, offsets, _spec(*spec_args), scale_after_fc2, tuple(needs)
    )


def mlp_forward_math(x, w1, b1, w2, b2, scales, offsets, spec: ActivationSpec, scale_after_fc2: bool):
    """``grouped_mlp_forward``'s ``(pre [M, N1], y [M, H])`` in functional torch ops (the
    decomposition runs under functionalization: nothing in place). Arguments as the op's:
    ``x [M, K]``, weights ``[G, N, K]``, biases ``[G, N]`` or None, ``scales [M]``, int32
    ``offsets [G]``."""
    rows = x.shape[0]
    pre = _gemm(x, _dense(w1).transpose(-2, -1), offsets)
    if b1 is not None:
        pre = pre + _row_bias(b1, offsets, rows)
    act = activation_forward(spec, pre)
    scale_col = scales.to(act.dtype).unsqueeze(-1)
    if not scale_after_fc2:
        act = act * scale_col
    y = _gemm(act, _dense(w2).transpose(-2, -1), offsets)
    if b2 is not None:
        y = y + _row_bias(b2, offsets, rows)
    if scale_after_fc2:
        y = y * scale_col
    return pre, y


def mlp_backward_math(dy, x, pre, w1, w2, b2, scales, offsets, spec: ActivationSpec, scale_after_fc2, needs):
    """``grouped_mlp_backward``'s six gradients ``(input, w1, b1, w2, b2, scales)``, empty
    where ``needs`` says not needed, in functional torch ops: the math of
    ``library._mlp_backward_impl``."""
    need_input, need_w1, need_b1, need_w2, need_b2, need_scales = needs
    rows, groups = dy.shape[0], w1.shape[0]
    act = activation_forward(spec, pre)
    scale_col = scales.to(act.dtype).unsqueeze(-1)
    grad_act_scaled = _gemm(dy, _dgrad_operand(_dense(w2)), offsets)
    grad_pre = activation_backward(spec, pre, grad_act_scaled * scale_col)
    empty = dy.new_empty(0)
    grad_scales = empty
    if need_scales:
        acc = torch.float64 if act.dtype == torch.float64 else torch.float32
        grad_scales = (act * grad_act_scaled).sum(-1, dtype=acc).to(scales.dtype)
        if scale_after_fc2 and b2 is not None:
            grad_scales = grad_scales + row_dot(dy, _row_bias(b2, offsets, rows), grad_scales.dtype)
    grad_w2 = _wgrad_like(w2, dy, act * scale_col, offsets) if need_w2 else empty
    grad_b2 = empty
    if need_b2:
        grad_b2 = _bias_grad(dy * scale_col if scale_after_fc2 else dy, offsets, groups)
    grad_input = _gemm(grad_pre, _dgrad_operand(_dense(w1)), offsets) if need_input else empty
    grad_w1 = _wgrad_like(w1, grad_pre, x, offsets) if need_w1 else empty
    grad_b1 = _bias_grad(grad_pre, offsets, groups) if need_b1 else empty
    return grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales


def register_for_tracing() -> None:
    """Add the decompositions to Inductor's table (idempotent; called while tracing).

    Called from the ops' fake implementations, which run while Dynamo traces, before
    Inductor reads its table. Imports Inductor (about a second, once) only in a process
    that has loaded Dynamo, so importing fusible_ops never does. Each op also gets its fallback lowering
    up front: Inductor refuses to make one later for an op that has a decomposition,
    and a declined call needs it.
    """
    global _registered
    if _registered or "torch._dynamo" not in sys.modules:
        return
    from torch._inductor import lowering
    from torch._inductor.decomposition import decompositions

    for op, decomposition in (
        (torch.ops.fusible_ops.grouped_mlp_forward.default, _mlp_forward),
        (torch.ops.fusible_ops.grouped_mlp_backward.default, _mlp_backward),
    ):
        if op not in lowering.lowerings:
            constraint = lowering.tag_to_layout_constraint(
                lowering.get_layout_constraint_tag(op, with_default=True)
            )
            lowering.make_fallback(op, layout_constraint=constraint, warn=False, override_decomp=True)
        decompositions[op] = decomposition
    _registered = True
