"""Triton backend: fused grouped-MLP kernels that write in place and never sync with the host.

Runs on CUDA GPUs of compute capability 8.0+ (Ampere, Hopper) in bfloat16/float16, and,
for testing only, on CPU tensors in Triton's interpreter (float32/float16) when
``TRITON_INTERPRET=1`` is set before Triton is first imported. The kernels live in
:mod:`fusible_ops.kernels.triton.kernels` (launched by :mod:`fusible_ops.kernels.triton.launch`) and are imported on first use.

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

from ..base import GroupedGemmBackend

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
    from ...core.settings import current_settings

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

    def _check_runnable(self, where: str, rows: torch.Tensor) -> None:
        reason = self.probe(rows.device, rows.dtype)
        if reason is not None:
            raise RuntimeError(f"{where}: cannot run on {rows.device.type} {rows.dtype}: {reason}")

    # ------------------------------------------------------------ hooks (arguments checked)
    def _fprop(self, x, weight, split_sizes, offsets, bias, out) -> torch.Tensor:
        return self._grouped_mm(x, weight.transpose(1, 2), offsets, bias, out)

    def _dgrad(self, grad_out, weight, split_sizes, offsets, out) -> torch.Tensor:
        return self._grouped_mm(grad_out, weight, offsets, None, out)

    def _wgrad(self, grad_out, x, split_sizes, offsets, out) -> torch.Tensor:
        from . import launch as triton_launch

        if out is None:
            out = x.new_empty(offsets.shape[0], grad_out.shape[1], x.shape[1])
        return triton_launch.wgrad(grad_out, x, offsets.contiguous(), out, autotune=autotune_enabled())

    def _fc1_fprop_act(self, x, weight, bias, split_sizes, offsets, activation, scales):
        """FC1 with ``act(pre) * scales`` in the epilogue: ``(pre [M, N_pre], act_scaled [M, N_act])``."""
        from . import launch as triton_launch

        return triton_launch.fc1_act(
            x, weight, bias, offsets.contiguous(), activation, scales, autotune=autotune_enabled()
        )

    def _fc2_dgrad_act(self, grad_y, weight, pre, split_sizes, offsets, activation, scales):
        """FC2 dgrad with d(activation) and d(scales) in the epilogue."""
        from . import launch as triton_launch

        return triton_launch.fc2_dgrad_act(
            grad_y, weight, pre, offsets.contiguous(), activation, scales, autotune=autotune_enabled()
        )

    @staticmethod
    def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets, bias, out) -> torch.Tensor:
        """``out[rows_g] = a[rows_g] @ b[g] (+ bias[g])``; a fresh output gets zeros past the last group."""
        from . import launch as triton_launch

        result = out if out is not None else a.new_empty(a.shape[0], b.shape[2])
        return triton_launch.grouped_mm(
            a, b, offsets.contiguous(), result, bias=bias, zero_tail=out is None, autotune=autotune_enabled()
        )
