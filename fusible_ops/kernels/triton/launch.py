"""Launchers for the Triton kernels of :mod:`.triton_kernels`: tile configurations,
autotuning (cached per shape), grids and the argument plumbing of each kernel.

Imported only from inside :class:`~fusible_ops.kernels.triton.backend.TritonBackend`
methods, never at package import. No launcher reads ``offsets`` on the host, so every
launch is free of host syncs and CUDA-graph capturable (once autotuning has run for the
shape, or with autotuning off).
"""

from __future__ import annotations

import torch
import triton

from ..activation import ActivationSpec
from .kernels import (
    _ACT_CODES,
    INTERPRETED,
    _fc1_act_kernel,
    _fc2_dgrad_act_kernel,
    _grouped_mm_kernel,
    _wgrad_kernel,
)

# ---------------------------------------------------------------- tile configurations


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = 8) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m}, num_warps=warps, num_stages=stages
    )


# Small tiles in the interpreter so that tiny test shapes still span several tiles.
_INTERPRETER_CONFIG = _cfg(16, 16, 16, 1, 1, group_m=2)

# GPU candidates (sized for H100/H200 shared memory; the first is the untuned default).
# The fc1 kernel keeps two accumulators, hence its narrower tiles.
_GPU_CONFIGS = {
    "mm": [
        _cfg(128, 128, 64, 8, 3),
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 64, 64, 4, 4),
        _cfg(64, 128, 64, 4, 4),
        _cfg(64, 64, 64, 4, 4),
    ],
    "fc1_act": [
        _cfg(128, 64, 64, 8, 3),
        _cfg(128, 128, 64, 8, 3),
        _cfg(64, 128, 64, 4, 3),
        _cfg(64, 64, 64, 4, 4),
    ],
    "fc2_dgrad_act": [
        _cfg(128, 64, 64, 8, 3),
        _cfg(128, 128, 64, 8, 3),
        _cfg(64, 128, 64, 4, 4),
        _cfg(64, 64, 64, 4, 4),
    ],
    # BLOCK_M is the (ragged) reduction tile here
    "wgrad": [
        _cfg(64, 128, 128, 8, 3),
        _cfg(64, 128, 64, 4, 4),
        _cfg(64, 64, 128, 4, 4),
        _cfg(32, 64, 64, 4, 4),
    ],
}

_KERNELS = {
    "mm": _grouped_mm_kernel,
    "fc1_act": _fc1_act_kernel,
    "fc2_dgrad_act": _fc2_dgrad_act_kernel,
    "wgrad": _wgrad_kernel,
}
# Autotune keys: shapes that pick a tile config; rows enter as a power-of-two bucket.
# The compile-time flags are part of the key: a config tuned for one activation or
# epilogue is not reused for another.
_AUTOTUNE_KEYS = {
    "mm": ["R", "J", "G", "M_BUCKET", "HAS_BIAS"],
    "fc1_act": ["N_ACT", "K", "G", "M_BUCKET", "KIND", "GATED", "HAS_BIAS", "HAS_SCALES"],
    "fc2_dgrad_act": ["N_ACT", "H", "G", "M_BUCKET", "KIND", "GATED", "HAS_SCALES"],
    "wgrad": ["N", "K", "G", "M_BUCKET"],
}
_autotuned: dict[str, object] = {}


def _launcher(name: str, autotune: bool):
    """``(kernel, config)``: the autotuned kernel with ``config=None``, or the raw kernel and its config."""
    if INTERPRETED:
        return _KERNELS[name], _INTERPRETER_CONFIG
    if not autotune:
        return _KERNELS[name], _GPU_CONFIGS[name][0]
    if name not in _autotuned:
        _autotuned[name] = triton.autotune(configs=_GPU_CONFIGS[name], key=_AUTOTUNE_KEYS[name])(
            _KERNELS[name]
        )
    return _autotuned[name], None


def _run(name: str, autotune: bool, grid, *args, **kwargs) -> dict[str, int]:
    """Launch kernel ``name``; returns the tile sizes of the config that ran."""
    kernel, config = _launcher(name, autotune)
    if config is None:
        kernel[grid](*args, **kwargs)
        config = kernel.best_config
    else:
        kernel[grid](
            *args, **kwargs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages
        )
    return config.kwargs


def autotune_cache_sizes() -> dict[str, int]:
    """Number of cached autotuning results per kernel (shapes tuned so far)."""
    return {name: len(kernel.cache) for name, kernel in _autotuned.items()}


def _block_g(num_groups: int) -> int:
    return triton.next_power_of_2(num_groups + 1)


def _m_bucket(m: int) -> int:
    return triton.next_power_of_2(max(m, 1))


def _row_grid(m: int, num_groups: int, cols: int):
    def grid(meta):
        num_pid_m = triton.cdiv(m, meta["BLOCK_M"]) + num_groups + 1
        return (num_pid_m * triton.cdiv(cols, meta["BLOCK_N"]),)

    return grid


# ---------------------------------------------------------------- launchers


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    zero_tail: bool,
    autotune: bool,
) -> torch.Tensor:
    """``out[rows_g] = a[rows_g] @ b[g] (+ bias[g])``; ``a [M, R]``, ``b [G, R, J]``, ``out [M, J]``.

    ``b`` may be any strided view (pass ``weight.transpose(1, 2)`` for fprop).
    """
    m, r = a.shape
    num_groups, _, j = b.shape
    if m == 0 or j == 0:
        return out
    bias_arg = bias if bias is not None else out
    bias_strides = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    _run(
        "mm", autotune, _row_grid(m, num_groups, j),
        a, b, bias_arg, out, offsets,
        m, r, j, num_groups, _m_bucket(m),
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        *bias_strides,
        out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, ZERO_TAIL=zero_tail, BLOCK_G=_block_g(num_groups),
    )  # fmt: skip
    return out


def _act_constants(spec: ActivationSpec) -> dict:
    return {
        "KIND": _ACT_CODES[spec.kind],
        "GATED": spec.gated,
        "INTERLEAVE": spec.glu_interleave_size or 0,
    }


def fc1_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    spec: ActivationSpec,
    scales: torch.Tensor | None,
    *,
    autotune: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(pre [M, N_pre], act_scaled [M, N_act])`` for ``x [M, K]``, ``weight [G, N_pre, K]``."""
    m, k = x.shape
    num_groups, n_pre, _ = weight.shape
    n_act = spec.output_features(n_pre)
    pre = torch.empty(m, n_pre, dtype=x.dtype, device=x.device)
    act = torch.empty(m, n_act, dtype=x.dtype, device=x.device)
    if m == 0 or n_act == 0:
        return pre, act
    bias_arg = bias if bias is not None else pre
    bias_strides = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    scales_arg = scales if scales is not None else pre
    _run(
        "fc1_act", autotune, _row_grid(m, num_groups, n_act),
        x, weight, bias_arg, scales_arg, pre, act, offsets,
        m, n_act, k, num_groups, _m_bucket(m),
        float(spec.limit), float(spec.alpha), float(spec.glu_linear_offset),
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2),
        *bias_strides,
        scales.stride(0) if scales is not None else 0,
        pre.stride(0), pre.stride(1),
        act.stride(0), act.stride(1),
        **_act_constants(spec),
        HAS_BIAS=bias is not None, HAS_SCALES=scales is not None, BLOCK_G=_block_g(num_groups),
    )  # fmt: skip
    return pre, act


def fc2_dgrad_act(
    grad_y: torch.Tensor,
    weight: torch.Tensor,
    pre: torch.Tensor,
    offsets: torch.Tensor,
    spec: ActivationSpec,
    scales: torch.Tensor | None,
    *,
    autotune: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Returns ``(grad_pre [M, N_pre], grad_scales [M] fp32 or None, act_scaled [M, N_act])``.

    ``grad_y [M, H]``, ``weight [G, H, N_act]`` (FC2's weight), ``pre [M, N_pre]``.
    """
    m, h = grad_y.shape
    num_groups, _, n_act = weight.shape
    n_pre = pre.shape[1]
    dtype, device = grad_y.dtype, grad_y.device
    grad_pre = torch.empty(m, n_pre, dtype=dtype, device=device)
    act = torch.empty(m, n_act, dtype=dtype, device=device)
    if m == 0 or n_act == 0:
        grad_scales = torch.zeros(m, dtype=torch.float32, device=device) if scales is not None else None
        return grad_pre.zero_(), grad_scales, act
    # Room for the narrowest column tile of any candidate config; the config that ran
    # writes its first cdiv(n_act, BLOCK_N) rows and the rest stay zero, so summing every
    # row is right whichever config ran (no reliance on reading back the tuner's choice).
    configs = [_INTERPRETER_CONFIG] if INTERPRETED else _GPU_CONFIGS["fc2_dgrad_act"]
    min_block_n = min(c.kwargs["BLOCK_N"] for c in configs)
    partial = torch.zeros(triton.cdiv(n_act, min_block_n), m, dtype=torch.float32, device=device)
    scales_arg = scales if scales is not None else pre
    _run(
        "fc2_dgrad_act", autotune, _row_grid(m, num_groups, n_act),
        grad_y, weight, pre, scales_arg, grad_pre, act, partial, offsets,
        m, n_act, h, num_groups, _m_bucket(m),
        float(spec.limit), float(spec.alpha), float(spec.glu_linear_offset),
        grad_y.stride(0), grad_y.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2),
        pre.stride(0), pre.stride(1),
        scales.stride(0) if scales is not None else 0,
        grad_pre.stride(0), grad_pre.stride(1),
        act.stride(0), act.stride(1),
        **_act_constants(spec),
        HAS_SCALES=scales is not None, BLOCK_G=_block_g(num_groups),
    )  # fmt: skip
    grad_scales = None
    if scales is not None:
        grad_scales = partial.sum(0)
    return grad_pre, grad_scales, act


def wgrad(
    grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, *, autotune: bool
) -> torch.Tensor:
    """``out[g] = grad_out[rows_g].T @ x[rows_g]``; ``grad_out [M, N]``, ``x [M, K]``, ``out [G, N, K]``."""
    m, n = grad_out.shape
    k = x.shape[1]
    num_groups = out.shape[0]
    if n == 0 or k == 0:
        return out

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"]), num_groups)

    _run(
        "wgrad", autotune, grid,
        grad_out, x, out, offsets,
        m, n, k, num_groups, _m_bucket(m),
        grad_out.stride(0), grad_out.stride(1),
        x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
    )  # fmt: skip
    return out
