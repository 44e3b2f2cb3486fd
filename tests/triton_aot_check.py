"""Compile the Triton kernels for Hopper (sm90) and Ampere (sm80) on a machine without a GPU.

The interpreter accepts code the compiler rejects, so this ahead-of-time build (with the
``ptxas`` that ships in the triton wheel) is what catches compile errors on CPU CI. It
emulates Triton's launch-time specialization (16-byte-divisible pointers and strides,
unit strides as constants) so that the software pipeline is built as on a real launch.

Run in a process where triton was imported *without* ``TRITON_INTERPRET=1``:
``python tests/triton_aot_check.py``. Exit status 0: all compiled; 1: a kernel failed
to compile; 3: this triton's ahead-of-time API differs (nothing was checked).
"""

from __future__ import annotations

import os
import sys

_API_MISMATCH = 3
_SIZE_ARGS = ("M", "R", "J", "K", "N", "H", "N_ACT")  # not G: the group count is arbitrary
#: shared memory per block (bytes) that each architecture allows
_SMEM_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


def _build(fn, arch: int, pointers: dict[str, str], constants: dict, unit_strides: list[str], config) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants or name in unit_strides:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("limit", "alpha", "glu_offset"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            # a real launch at the shapes we target (hidden 1024/4096, ffn 1408/14336, rows a
            # multiple of 16) sees strides and sizes divisible by 16, which is what lets
            # Triton vectorise the K masks and build the software pipeline
            if name.startswith("stride") or name in _SIZE_ARGS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {**constants, **config.kwargs, **{name: 1 for name in unit_strides}}
    try:
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        target = GPUTarget("cuda", arch, 32)
    except (TypeError, AttributeError) as error:
        print(f"triton ahead-of-time API mismatch: {error}")
        sys.exit(_API_MISMATCH)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    kernel = triton.compile(source, target=target, options=options)
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "no tensor-core MMA")
    shared = kernel.metadata.shared
    if shared > _SMEM_LIMIT[arch]:
        raise RuntimeError(f"sm{arch} {fn.__name__}: needs {shared} B of shared memory > {_SMEM_LIMIT[arch]}")
    return f"sm{arch} {fn.__name__}: {mma}, shared {shared} B"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this check compiles the kernels")
        return _API_MISMATCH
    from fusible_ops.kernels.triton import kernels as tk
    from fusible_ops.kernels.triton.launch import _GPU_CONFIGS

    bf16, i32, f32 = "*bf16", "*i32", "*fp32"
    failures = 0
    for arch in (90, 80):
        builds = [
            (  # fprop with bias: b = weight.transpose(1, 2), unit stride along the reduction
                tk._grouped_mm_kernel,
                dict(a_ptr=bf16, b_ptr=bf16, bias_ptr=bf16, c_ptr=bf16, offsets_ptr=i32),
                dict(HAS_BIAS=True, ZERO_TAIL=True, BLOCK_G=16),
                ["stride_ar", "stride_br", "stride_cj", "stride_biasj"],
                _GPU_CONFIGS["mm"][0],
            ),
            (  # dgrad: b = weight, unit stride along the output columns
                tk._grouped_mm_kernel,
                dict(a_ptr=bf16, b_ptr=bf16, bias_ptr=bf16, c_ptr=bf16, offsets_ptr=i32),
                dict(HAS_BIAS=False, ZERO_TAIL=False, BLOCK_G=16),
                ["stride_ar", "stride_bj", "stride_cj"],
                _GPU_CONFIGS["mm"][1],
            ),
            (
                tk._fc1_act_kernel,
                dict(
                    x_ptr=bf16,
                    w_ptr=bf16,
                    bias_ptr=bf16,
                    scales_ptr=f32,
                    pre_ptr=bf16,
                    act_ptr=bf16,
                    offsets_ptr=i32,
                ),
                dict(KIND=7, GATED=True, INTERLEAVE=1, HAS_BIAS=True, HAS_SCALES=True, BLOCK_G=16),
                ["stride_xk", "stride_wk", "stride_biasn", "stride_s", "stride_pn", "stride_actn"],
                _GPU_CONFIGS["fc1_act"][0],
            ),
            (
                tk._fc2_dgrad_act_kernel,
                dict(
                    dy_ptr=bf16,
                    w_ptr=bf16,
                    pre_ptr=bf16,
                    scales_ptr=f32,
                    grad_pre_ptr=bf16,
                    act_ptr=bf16,
                    partial_ptr=f32,
                    offsets_ptr=i32,
                ),  # fmt: skip
                dict(KIND=4, GATED=True, INTERLEAVE=0, HAS_SCALES=True, BLOCK_G=16),
                ["stride_dyh", "stride_wn", "stride_pn", "stride_s", "stride_gn", "stride_actn"],
                _GPU_CONFIGS["fc2_dgrad_act"][0],
            ),
            (
                tk._wgrad_kernel,
                dict(dy_ptr=bf16, x_ptr=bf16, out_ptr=bf16, offsets_ptr=i32),
                {},
                ["stride_dyn", "stride_xk", "stride_ok"],
                _GPU_CONFIGS["wgrad"][0],
            ),
        ]
        for fn, pointers, constants, unit_strides, config in builds:
            try:
                print(_build(fn, arch, pointers, constants, unit_strides, config))
            except SystemExit:
                raise
            except Exception as error:  # a compile error in one kernel: report it, keep going
                failures += 1
                print(f"sm{arch} {fn.__name__}: FAILED to compile: {type(error).__name__}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
