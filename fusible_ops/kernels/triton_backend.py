"""Triton backend: fused grouped-MLP kernels that write in place and never sync with the host.

Runs on CUDA GPUs of compute capability 8.0+ (Ampere, Hopper) in bfloat16/float16, and,
for testing only, on CPU tensors in Triton's interpreter (float32/float16) when
``TRITON_INTERPRET=1`` is set before Triton is first imported. The kernels live in
:mod:`fusible_ops.kernels.triton_kernels` (launched by :mod:`fusible_ops.kernels.triton_launch`) and are imported on first use.

Autotuning: the first call for each shape (features, groups, power-of-two row bucket)
benchmarks a few tile configurations and caches the best; this syncs with the device
once per shape. Skip it (and use the first, default configuration) with
``fusible_ops.settings(triton_autotune=False)`` or process-wide with
:func:`set_autotune`. Do the tuning calls before capturing a CUDA graph, or turn it off.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from .activation import ActivationSpec
from .base import GroupedGemmBackend
from .grouped_checks import (
    check_bias,
    check_dgrad,
    check_fprop,
    check_operands,
    check_weight,
    check_wgrad,
)

_CUDA_DTYPES = (torch.bfloat16, torch.float16)
# bfloat16 tl.dot returns garbage in the triton 3.9 interpreter (numpy has no bfloat16).
_INTERPRETER_DTYPES = (torch.float32, torch.float16)
_MIN_CAPABILITY = (8, 0)

_autotune_default = True


def set_autotune(enabled: bool) -> None:
    """Process-wide switch for Triton autotuning (``settings(triton_autotune=...)`` also applies)."""
    global _autotune_default
    _autotune_default = bool(enabled)


def autotune_enabled() -> bool:
    """Whether the next launch may autotune: :func:`set_autotune` and the active settings agree."""
    from ..settings import current_settings

    return _autotune_default and bool(getattr(current_settings(), "triton_autotune", True))


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _loaded_mode() -> str | None:
    """Return "interpreter" or "compiled" once Triton is imported (fixed then), else None."""
    if "triton" not in sys.modules:
        return None
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return "interpreter" if isinstance(tl.sigmoid, InterpretedFunction) else "compiled"


class TritonBackend(GroupedGemmBackend):
    """Grouped GEMMs and the fused FC1-activation / FC2-dgrad-activation kernels in Triton."""

    name = "triton"
    description = (
        "Triton kernels: grouped GEMMs reading device offsets (no host sync), activation and "
        "per-row scale fused into the FC1 / FC2-dgrad epilogues, in-place outputs; CUDA SM80+ "
        "bf16/fp16, or CPU fp32/fp16 in the Triton interpreter (TRITON_INTERPRET=1, tests only)"
    )
    fused_activation = True
    writes_in_place = True

    # ------------------------------------------------------------ availability
    def package_status(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        return None

    def probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        missing = self.package_status()
        if missing is not None:
            return missing
        device = torch.device(device)
        mode = _loaded_mode()
        if device.type == "cuda":
            if mode == "interpreter" or (mode is None and _interpret_requested()):
                return "TRITON_INTERPRET=1: the kernels would run in Triton's interpreter, not on the GPU"
            if not torch.cuda.is_available():
                return "CUDA is not available"
            capability = torch.cuda.get_device_capability(device)
            if capability < _MIN_CAPABILITY:
                major, minor = capability
                return f"needs compute capability 8.0+ (Ampere or newer), this GPU is {major}.{minor}"
            if dtype not in _CUDA_DTYPES:
                return f"runs bfloat16 and float16 on CUDA, not {dtype}"
            return None
        if device.type == "cpu":
            if mode == "compiled":
                return (
                    "CPU tensors need Triton's interpreter, but triton was imported before TRITON_INTERPRET=1"
                )
            if mode is None and not _interpret_requested():
                return (
                    "CPU tensors only run in Triton's interpreter: set TRITON_INTERPRET=1 (tests only, slow)"
                )
            if dtype not in _INTERPRETER_DTYPES:
                return f"the Triton interpreter runs float32 and float16 here, not {dtype}"
            return None
        return f"runs on CUDA (or CPU in Triton's interpreter), not {device.type}"

    def mode(self) -> str:
        """How the kernels run in this process, for ``info`` and the fusion plan."""
        mode = _loaded_mode()
        if mode == "interpreter" or (mode is None and _interpret_requested()):
            return "Triton interpreter (TRITON_INTERPRET=1): for testing indexing and masking, slow"
        tuning = "autotuned per shape" if autotune_enabled() else "autotuning off: default tiles"
        return f"compiled Triton kernels ({tuning})"

    def _require(self, where: str, t: torch.Tensor) -> None:
        reason = self.probe(t.device, t.dtype)
        if reason is not None:
            raise RuntimeError(f"{where}: cannot run on {t.device.type} {t.dtype}: {reason}")

    # ------------------------------------------------------------ grouped GEMMs
    def fprop(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[rows_g] = x[rows_g] @ weight[g].T (+ bias[g])``: ``[M, K] -> [M, N]``."""
        where = f"{self.name}.fprop"
        groups, n_out, k_in = check_fprop(where, x, weight, split_sizes, offsets, bias, out)
        self._require(where, x)
        from . import triton_launch

        result = out if out is not None else torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
        return triton_launch.grouped_mm(
            x,
            weight.transpose(1, 2),
            offsets.contiguous(),
            result,
            bias=bias,
            zero_tail=out is None,
            autotune=autotune_enabled(),
        )

    def dgrad(
        self,
        grad_out: torch.Tensor,
        weight: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[rows_g] = grad_out[rows_g] @ weight[g]``: ``[M, N] -> [M, K]``."""
        where = f"{self.name}.dgrad"
        groups, n_out, k_in = check_dgrad(where, grad_out, weight, split_sizes, offsets, out)
        self._require(where, grad_out)
        from . import triton_launch

        rows = grad_out.shape[0]
        result = (
            out if out is not None else torch.empty(rows, k_in, dtype=grad_out.dtype, device=grad_out.device)
        )
        return triton_launch.grouped_mm(
            grad_out,
            weight,
            offsets.contiguous(),
            result,
            bias=None,
            zero_tail=out is None,
            autotune=autotune_enabled(),
        )

    def wgrad(
        self,
        grad_out: torch.Tensor,
        x: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[g] = grad_out[rows_g].T @ x[rows_g]``: ``[G, N, K]``, zeros for empty groups."""
        where = f"{self.name}.wgrad"
        shape = check_wgrad(where, grad_out, x, split_sizes, offsets, out)
        self._require(where, x)
        from . import triton_launch

        result = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
        return triton_launch.wgrad(grad_out, x, offsets.contiguous(), result, autotune=autotune_enabled())

    # ------------------------------------------------------------ fused entry points
    def fc1_fprop_act(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        activation: ActivationSpec,
        scales: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FC1 with ``act(pre) * scales`` in the epilogue: ``(pre [M, N_pre], act_scaled [M, N_act])``."""
        where = f"{self.name}.fc1_fprop_act"
        groups = check_operands(where, x, weight, split_sizes, offsets, lhs_name="x", rhs_name="weight")
        check_weight(where, weight, groups)
        n_pre, k_in = weight.shape[1], weight.shape[2]
        if x.shape[1] != k_in:
            raise ValueError(f"{where}: x has {x.shape[1]} features but weight expects {k_in}")
        check_bias(where, bias, groups, n_pre, x.dtype)
        _check_activation_width(where, activation, n_pre)
        _check_scales(where, scales, x)
        self._require(where, x)
        from . import triton_launch

        return triton_launch.fc1_act(
            x, weight, bias, offsets.contiguous(), activation, _scales_1d(scales), autotune=autotune_enabled()
        )

    def fc2_dgrad_act(
        self,
        grad_y: torch.Tensor,
        weight: torch.Tensor,
        pre: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        activation: ActivationSpec,
        scales: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """FC2 dgrad with d(activation) and d(scales) in the epilogue.

        ``grad_y [M, H]``, FC2 ``weight [G, H, N_act]``, ``pre [M, N_pre]``. Returns
        ``(grad_pre, grad_scales, act_scaled)``; ``grad_scales`` has ``scales``' dtype and shape.
        """
        where = f"{self.name}.fc2_dgrad_act"
        groups = check_operands(
            where, grad_y, weight, split_sizes, offsets, lhs_name="grad_y", rhs_name="weight"
        )
        check_weight(where, weight, groups)
        h_out, n_act = weight.shape[1], weight.shape[2]
        if grad_y.shape[1] != h_out:
            raise ValueError(f"{where}: grad_y has {grad_y.shape[1]} features but weight has {h_out} outputs")
        if pre.dim() != 2 or pre.shape[0] != grad_y.shape[0]:
            raise ValueError(f"{where}: pre must be [{grad_y.shape[0]}, N_pre], got {tuple(pre.shape)}")
        if pre.dtype != grad_y.dtype or pre.device != grad_y.device:
            raise TypeError(
                f"{where}: pre ({pre.dtype}, {pre.device}) must match "
                f"grad_y ({grad_y.dtype}, {grad_y.device})"
            )
        _check_activation_width(where, activation, pre.shape[1])
        if activation.output_features(pre.shape[1]) != n_act:
            raise ValueError(
                f"{where}: {activation.kind} of pre with {pre.shape[1]} features gives "
                f"{activation.output_features(pre.shape[1])}, but weight expects {n_act}"
            )
        _check_scales(where, scales, grad_y)
        self._require(where, grad_y)
        from . import triton_launch

        grad_pre, grad_scales, act = triton_launch.fc2_dgrad_act(
            grad_y,
            weight,
            pre,
            offsets.contiguous(),
            activation,
            _scales_1d(scales),
            autotune=autotune_enabled(),
        )
        if grad_scales is not None:
            grad_scales = grad_scales.to(scales.dtype).reshape(scales.shape)
        return grad_pre, grad_scales, act


def _check_activation_width(where: str, activation: ActivationSpec, n_pre: int) -> None:
    if not activation.gated:
        return
    block = 2 * (activation.glu_interleave_size or 1)
    if n_pre % block:
        raise ValueError(
            f"{where}: {activation.kind} needs the pre-activation width ({n_pre}) to be a multiple of {block}"
        )


def _check_scales(where: str, scales: torch.Tensor | None, rows_like: torch.Tensor) -> None:
    if scales is None:
        return
    rows = rows_like.shape[0]
    if tuple(scales.shape) not in ((rows,), (rows, 1)):
        raise ValueError(f"{where}: scales must be [{rows}] (one per row), got {tuple(scales.shape)}")
    if not scales.is_floating_point():
        raise TypeError(f"{where}: scales must be floating point, got {scales.dtype}")
    if scales.device != rows_like.device:
        raise ValueError(f"{where}: scales are on {scales.device} but the input is on {rows_like.device}")


def _scales_1d(scales: torch.Tensor | None) -> torch.Tensor | None:
    return None if scales is None else scales.reshape(scales.shape[0])
