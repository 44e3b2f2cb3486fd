"""Side-by-side CPU candidates for the grouped MLP's GEMMs and activation passes.

Run: ``python benchmarks/cpu_gemm_candidates.py [--rounds 7] [--sections gemm,act,e2e,small] [--compile]``

All candidates of a section run in one process, interleaved round by round (so load
from other processes hits them alike); the table reports medians over rounds and
ratios to the dense bound measured in the same rounds. Default shape (the bench default):
8 experts, hidden 1024, ffn 1408 (fc1 out 2816), 8192 rows, uneven splits with one
empty expert, bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusible_ops.kernels.activation import (  # noqa: E402
    ActivationSpec,
    scaled_activation_backward,
    scaled_activation_forward,
)
from fusible_ops.kernels.cpu.backend import TorchCpuBackend  # noqa: E402
from fusible_ops.kernels.pytorch.grouped_mm import TorchGroupedMMBackend  # noqa: E402
from fusible_ops.kernels.pytorch.loop import TorchLoopBackend  # noqa: E402

SPLITS = [1536, 512, 0, 2048, 768, 1280, 1024, 1024]  # 8192 rows, expert 2 empty
HIDDEN, FFN = 1024, 1408
SWIGLU = ActivationSpec("swiglu")


def run_interleaved(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per candidate; one warm-up call each, then ``rounds`` interleaved rounds."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_table(title: str, medians: dict[str, float], flops: dict[str, float], baseline: str) -> None:
    print(f"\n### {title}\n")
    print("| candidate | median ms | TFLOP/s | x baseline |")
    print("|---|---:|---:|---:|")
    base = medians[baseline]
    for name, sec in medians.items():
        tflops = flops.get(name, 0.0) / sec / 1e12 if flops.get(name) else float("nan")
        print(f"| {name} | {sec * 1e3:.2f} | {tflops:.3f} | {sec / base:.3f} |")


class Problem:
    """The tensors of one grouped-MLP forward+backward at the benchmark shape."""

    def __init__(self, dtype: torch.dtype, splits: list[int], hidden: int, ffn: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.splits = splits
        self.groups, self.rows = len(splits), sum(splits)
        self.offsets = torch.tensor(splits).cumsum(0).to(torch.int32)
        g, m, h, f = self.groups, self.rows, hidden, ffn

        def randn(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)

        self.x = randn(m, h)
        self.w1 = randn(g, 2 * f, h)
        self.w2 = randn(g, h, f)
        self.pre = randn(m, 2 * f) * 20
        self.act = randn(m, f)
        self.grad_y = randn(m, h)
        self.grad_pre = randn(m, 2 * f)
        self.scales = torch.rand(m, generator=gen)
        # dense-bound operands: one expert's weight used for all rows, contiguous
        self.w1_dense, self.w2_dense = self.w1[0].contiguous(), self.w2[0].contiguous()
        self.out_fc1 = torch.empty(m, 2 * f, dtype=dtype)
        self.out_fc2 = torch.empty(m, h, dtype=dtype)
        self.out_dgrad2 = torch.empty(m, f, dtype=dtype)
        self.out_dgrad1 = torch.empty(m, h, dtype=dtype)
        self.out_w1 = torch.empty(g, 2 * f, h, dtype=dtype)
        self.out_w2 = torch.empty(g, h, f, dtype=dtype)
        self.gemm_flops = {
            "fc1 fprop": 2 * m * h * 2 * f,
            "fc2 fprop": 2 * m * f * h,
            "fc2 dgrad": 2 * m * h * f,
            "fc2 wgrad": 2 * m * h * f,
            "fc1 dgrad": 2 * m * 2 * f * h,
            "fc1 wgrad": 2 * m * 2 * f * h,
        }


# ---------------------------------------------------------------- section 1: GEMMs


def gemm_section(p: Problem, rounds: int) -> None:
    loop, gmm = TorchLoopBackend(), TorchGroupedMMBackend()
    s, o = p.splits, p.offsets
    w1_t = p.w1.transpose(1, 2).contiguous()  # [G, K, N]: pre-transposed weights
    w2_t = p.w2.transpose(1, 2).contiguous()

    def per_group_t_wgrad(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        start = 0
        for g, size in enumerate(s):
            if size:
                torch.mm(grad[start : start + size].t().contiguous(), x[start : start + size], out=out[g])
            else:
                out[g].zero_()
            start += size

    def whole_t_wgrad(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        grad_t = grad.t().contiguous()  # [N, M]: one transpose, then column slices
        start = 0
        for g, size in enumerate(s):
            if size:
                torch.mm(grad_t[:, start : start + size], x[start : start + size], out=out[g])
            else:
                out[g].zero_()
            start += size

    def nn_fprop(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> None:
        start = 0
        for g, size in enumerate(s):
            if size:
                torch.mm(x[start : start + size], w_t[g], out=out[start : start + size])
            start += size

    def nt_dgrad(grad: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> None:
        start = 0
        for g, size in enumerate(s):
            if size:
                torch.mm(grad[start : start + size], w_t[g].t(), out=out[start : start + size])
            start += size

    bias1 = torch.zeros(p.groups, p.w1.shape[1], dtype=p.x.dtype)

    def mm_then_bias(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> None:
        start = 0
        for g, size in enumerate(s):
            if size:
                torch.mm(x[start : start + size], w[g].t(), out=out[start : start + size])
                out[start : start + size].add_(bias[g])
            start += size

    per_gemm = {
        "fc1 fprop": {
            "dense mm": lambda: torch.mm(p.x, p.w1_dense.t(), out=p.out_fc1),
            "loop mm(out=slice)": lambda: loop.fprop(p.x, p.w1, s, o, out=p.out_fc1),
            "loop mm(out=slice), fresh out": lambda: loop.fprop(p.x, p.w1, s, o),
            "loop addmm(bias, out=slice)": lambda: loop.fprop(p.x, p.w1, s, o, bias=bias1, out=p.out_fc1),
            "loop mm then bias add_": lambda: mm_then_bias(p.x, p.w1, bias1, p.out_fc1),
            "loop, W pre-transposed": lambda: nn_fprop(p.x, w1_t, p.out_fc1),
            "torch._grouped_mm": lambda: gmm.fprop(p.x, p.w1, s, o),
        },
        "fc2 fprop": {
            "dense mm": lambda: torch.mm(p.act, p.w2_dense.t(), out=p.out_fc2),
            "loop mm(out=slice)": lambda: loop.fprop(p.act, p.w2, s, o, out=p.out_fc2),
            "loop, W pre-transposed": lambda: nn_fprop(p.act, w2_t, p.out_fc2),
            "torch._grouped_mm": lambda: gmm.fprop(p.act, p.w2, s, o),
        },
        "fc2 dgrad": {
            "dense mm": lambda: torch.mm(p.grad_y, p.w2_dense, out=p.out_dgrad2),
            "loop mm(out=slice)": lambda: loop.dgrad(p.grad_y, p.w2, s, o, out=p.out_dgrad2),
            "loop, W pre-transposed": lambda: nt_dgrad(p.grad_y, w2_t, p.out_dgrad2),
            "torch._grouped_mm": lambda: gmm.dgrad(p.grad_y, p.w2, s, o),
        },
        "fc1 dgrad": {
            "dense mm": lambda: torch.mm(p.grad_pre, p.w1_dense, out=p.out_dgrad1),
            "loop mm(out=slice)": lambda: loop.dgrad(p.grad_pre, p.w1, s, o, out=p.out_dgrad1),
            "loop, W pre-transposed": lambda: nt_dgrad(p.grad_pre, w1_t, p.out_dgrad1),
            "torch._grouped_mm": lambda: gmm.dgrad(p.grad_pre, p.w1, s, o),
        },
        "fc2 wgrad": {
            "dense mm": lambda: torch.mm(p.grad_y.t(), p.act, out=p.out_w2[0]),
            "loop mm(out=slice)": lambda: loop.wgrad(p.grad_y, p.act, s, o, out=p.out_w2),
            "loop, grad.T contiguous per group": lambda: per_group_t_wgrad(p.grad_y, p.act, p.out_w2),
            "loop, grad.T contiguous once": lambda: whole_t_wgrad(p.grad_y, p.act, p.out_w2),
            "torch._grouped_mm": lambda: gmm.wgrad(p.grad_y, p.act, s, o),
        },
        "fc1 wgrad": {
            "dense mm": lambda: torch.mm(p.grad_pre.t(), p.x, out=p.out_w1[0]),
            "loop mm(out=slice)": lambda: loop.wgrad(p.grad_pre, p.x, s, o, out=p.out_w1),
            "loop, grad.T contiguous per group": lambda: per_group_t_wgrad(p.grad_pre, p.x, p.out_w1),
            "loop, grad.T contiguous once": lambda: whole_t_wgrad(p.grad_pre, p.x, p.out_w1),
            "torch._grouped_mm": lambda: gmm.wgrad(p.grad_pre, p.x, s, o),
        },
    }
    for gemm, candidates in per_gemm.items():
        medians = run_interleaved(candidates, rounds)
        flops = {name: p.gemm_flops[gemm] for name in candidates}
        print_table(f"GEMM {gemm}", medians, flops, "dense mm")


# ---------------------------------------------------------------- section 2: activation passes


def _compiled_blocks():
    """torch.compile'd SwiGLU fwd/bwd bodies; returns (fwd, bwd) or raises."""

    def fwd(pre: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        n = pre.shape[-1] // 2
        gate, lin = pre[:, :n].float(), pre[:, n:].float()
        return (torch.nn.functional.silu(gate) * lin * scales[:, None]).to(pre.dtype)

    def bwd(pre: torch.Tensor, scales: torch.Tensor, grad_out: torch.Tensor):
        n = pre.shape[-1] // 2
        gate, lin = pre[:, :n].float(), pre[:, n:].float()
        sig = torch.sigmoid(gate)
        silu = gate * sig
        act = silu * lin
        g = grad_out.float()
        grad_scales = (act * g).sum(-1)
        ga = g * scales[:, None]
        grad_gate = ga * lin * (sig + silu * (1 - sig))
        grad_lin = ga * silu
        grad_pre = torch.cat([grad_gate, grad_lin], dim=-1).to(pre.dtype)
        return grad_pre, grad_scales, (act * scales[:, None]).to(pre.dtype)

    return torch.compile(fwd, dynamic=False), torch.compile(bwd, dynamic=False)


def activation_section(p: Problem, rounds: int, use_compile: bool) -> None:
    s, o = p.splits, p.offsets
    loop = TorchLoopBackend()
    cpu_blocks = {}
    for block in (64, 128, 256, 512, 1024):
        backend = TorchCpuBackend()
        backend.row_block = block
        cpu_blocks[block] = backend

    def composed_fwd():
        return scaled_activation_forward(SWIGLU, p.pre, p.scales)

    def composed_bwd():
        grad_act = loop.dgrad(p.grad_y, p.w2, s, o)
        grad_pre, grad_scales = scaled_activation_backward(SWIGLU, p.pre, p.scales, grad_act)
        return grad_pre, grad_scales, scaled_activation_forward(SWIGLU, p.pre, p.scales)

    generic = TorchCpuBackend()
    generic._is_fast_swiglu = staticmethod(lambda spec: False)  # reference math, blocked

    fwd = {
        "composed (activation.py, full tensors)": composed_fwd,
        **{
            f"cpu fused, row_block={b}": (
                lambda be=be: be.fc1_fprop_act(p.x, p.w1, None, s, o, SWIGLU, p.scales)[1]
            )
            for b, be in cpu_blocks.items()
        },
    }
    # fc1_fprop_act includes the FC1 GEMM; give composed the same GEMM so the rows compare
    fwd["composed (activation.py, full tensors)"] = lambda: (
        loop.fprop(p.x, p.w1, s, o),
        composed_fwd(),
    )
    fwd["GEMM only (no activation)"] = lambda: loop.fprop(p.x, p.w1, s, o)
    fwd["cpu blocked, generic math, row_block=256"] = lambda: generic.fc1_fprop_act(
        p.x, p.w1, None, s, o, SWIGLU, p.scales
    )
    bwd = {
        "composed dgrad + activation.py bwd + recompute": composed_bwd,
        "GEMM only (fc2 dgrad, no activation)": lambda: loop.dgrad(p.grad_y, p.w2, s, o),
        **{
            f"cpu fused, row_block={b}": (
                lambda be=be: be.fc2_dgrad_act(p.grad_y, p.w2, p.pre, s, o, SWIGLU, p.scales)
            )
            for b, be in cpu_blocks.items()
        },
        "cpu blocked, generic math, row_block=256": lambda: generic.fc2_dgrad_act(
            p.grad_y, p.w2, p.pre, s, o, SWIGLU, p.scales
        ),
    }
    if use_compile:
        try:
            c_fwd, c_bwd = _compiled_blocks()
            start = time.perf_counter()
            c_fwd(p.pre, p.scales)
            c_bwd(p.pre, p.scales, p.act)
            print(f"\ntorch.compile first calls (fwd+bwd, full tensors): {time.perf_counter() - start:.1f} s")
            fwd["GEMM + torch.compile'd pointwise (full tensors)"] = lambda: (
                loop.fprop(p.x, p.w1, s, o),
                c_fwd(p.pre, p.scales),
            )
            bwd["dgrad + torch.compile'd pointwise (full tensors)"] = lambda: c_bwd(
                p.pre, p.scales, loop.dgrad(p.grad_y, p.w2, s, o)
            )
        except Exception as exc:  # report and go on: compile is only a candidate
            print(f"\ntorch.compile candidate failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    flops_fwd = {name: p.gemm_flops["fc1 fprop"] for name in fwd}
    flops_bwd = {name: p.gemm_flops["fc2 dgrad"] for name in bwd}
    print_table(
        "FC1 GEMM + SwiGLU*probs forward",
        run_interleaved(fwd, rounds),
        flops_fwd,
        "GEMM only (no activation)",
    )
    print_table(
        "FC2 dgrad + SwiGLU*probs backward + recompute",
        run_interleaved(bwd, rounds),
        flops_bwd,
        "GEMM only (fc2 dgrad, no activation)",
    )


# ---------------------------------------------------------------- section 3: end to end


def mlp_fwd_bwd(backend, p: Problem) -> None:
    """The six GEMMs + activation of the fused op's forward and backward, no autograd."""
    s, o = p.splits, p.offsets
    pre, act = backend.fc1_fprop_act(p.x, p.w1, None, s, o, SWIGLU, p.scales)
    backend.fprop(act, p.w2, s, o, out=p.out_fc2)
    grad_pre, _, act = backend.fc2_dgrad_act(p.grad_y, p.w2, pre, s, o, SWIGLU, p.scales)
    backend.wgrad(p.grad_y, act, s, o, out=p.out_w2)
    backend.dgrad(grad_pre, p.w1, s, o, out=p.out_dgrad1)
    backend.wgrad(grad_pre, p.x, s, o, out=p.out_w1)


def dense_bound(p: Problem) -> None:
    """The same six GEMMs as plain torch.mm on contiguous operands."""
    torch.mm(p.x, p.w1_dense.t(), out=p.out_fc1)
    torch.mm(p.act, p.w2_dense.t(), out=p.out_fc2)
    torch.mm(p.grad_y, p.w2_dense, out=p.out_dgrad2)
    torch.mm(p.grad_y.t(), p.act, out=p.out_w2[0])
    torch.mm(p.grad_pre, p.w1_dense, out=p.out_dgrad1)
    torch.mm(p.grad_pre.t(), p.x, out=p.out_w1[0])


def e2e_section(p: Problem, rounds: int) -> None:
    # one instance per backend, as the registry keeps them (the cpu backend's output pool lives there)
    cpu, loop, gmm = TorchCpuBackend(), TorchLoopBackend(), TorchGroupedMMBackend()
    cpu_no_reuse = TorchCpuBackend()
    cpu_no_reuse.reuse_buffers = False
    candidates = {
        "dense bound (6 x torch.mm)": lambda: dense_bound(p),
        "cpu backend (fused act)": lambda: mlp_fwd_bwd(cpu, p),
        "cpu backend, reuse_buffers=False": lambda: mlp_fwd_bwd(cpu_no_reuse, p),
        "torch_loop backend (composed act)": lambda: mlp_fwd_bwd(loop, p),
        "grouped_mm backend (composed act)": lambda: mlp_fwd_bwd(gmm, p),
    }
    flops = sum(p.gemm_flops.values())
    print_table(
        "forward+backward, kernels only (no autograd, no framework)",
        run_interleaved(candidates, rounds),
        dict.fromkeys(candidates, flops),
        "dense bound (6 x torch.mm)",
    )


def small_section(rounds: int, dtype: torch.dtype) -> None:
    """Tiny problems: one dense GEMM over all groups (the cpu default) vs one GEMM per group."""
    dense_path, per_group = TorchCpuBackend(), TorchCpuBackend()
    per_group.small_problem_macs = 0
    print(
        f"\n### tiny shapes, forward+backward kernels (cpu small_problem_macs = {dense_path.small_problem_macs})\n"
    )
    print(
        "| experts | rows | hidden | ffn | fc1 groups*rows*out*in | dense-over-groups us | per-group us | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    shapes = [
        (64, 64, [34, 0, 14, 16]),  # the bench --small shape
        (64, 64, [0, 0, 64, 32, 32, 32, 32, 64]),
        (128, 128, [0, 0, 128, 64, 64, 64, 64, 128]),
        (128, 128, [0, 0, 256, 128, 128, 128, 128, 256]),
    ]
    for hidden, ffn, splits in shapes:
        p = Problem(dtype, splits, hidden, ffn)
        medians = run_interleaved(
            {
                "dense": lambda p=p: mlp_fwd_bwd(dense_path, p),
                "per_group": lambda p=p: mlp_fwd_bwd(per_group, p),
            },
            rounds * 10,
        )
        macs = len(splits) * p.rows * 2 * ffn * hidden
        print(
            f"| {len(splits)} | {p.rows} | {hidden} | {ffn} | {macs:.3g} | {medians['dense'] * 1e6:.0f} | "
            f"{medians['per_group'] * 1e6:.0f} | {medians['dense'] / medians['per_group']:.2f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sections", default="gemm,act,e2e,small")
    parser.add_argument("--compile", action="store_true", help="add torch.compile'd pointwise candidates")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dtype}, THP_MEM_ALLOC_ENABLE={thp}"
    )
    print(f"shape: experts {len(SPLITS)}, hidden {HIDDEN}, ffn {FFN}, rows {sum(SPLITS)}, splits {SPLITS}")
    p = Problem(dtype, SPLITS, HIDDEN, FFN)
    sections = args.sections.split(",")
    with torch.no_grad():
        if "gemm" in sections:
            gemm_section(p, args.rounds)
        if "act" in sections:
            activation_section(p, args.rounds, args.compile)
        if "e2e" in sections:
            e2e_section(p, args.rounds)
        if "small" in sections:
            small_section(args.rounds, dtype)


if __name__ == "__main__":
    main()
