"""The fused expert block on the CPU at fine-grained and GPT-OSS-like shapes, against the
grouped bound: the same per-expert GEMMs alone (``torch.mm`` into pre-allocated outputs,
2 in forward, 6 in forward+backward), nothing else. Also the CPU backend's one-GEMM
small-problem path against its per-group path at 512 rows.

Interleaved rounds in one process (each round times every variant once, in a shuffled
order); medians with min and max.

    python benchmarks/cpu_shapes.py [--rounds 10] [--sections fine,gptoss,small]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import fusible_ops as fo


def skewed_splits(experts: int, rows: int, seed: int = 0) -> list[int]:
    """Zipf-like counts (a few hot experts, several empty ones) summing to ``rows``."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.1
    weights = weights[torch.randperm(experts, generator=gen)]
    weights[torch.randperm(experts, generator=gen)[: experts // 8]] = 0.0
    counts = (weights / weights.sum() * rows).floor().long()
    counts[int(weights.argmax())] += rows - int(counts.sum())
    return counts.tolist()


def block(kind: str, experts: int, hidden: int, ffn: int, dtype: torch.dtype) -> fo.Sequential:
    torch.manual_seed(0)
    if kind == "gptoss":
        return fo.Sequential(
            fo.GroupedLinear(experts, hidden, 2 * ffn, bias=True, dtype=dtype),
            fo.ClampedSwiGLU(limit=7.0, alpha=1.702, glu_linear_offset=1.0),
            fo.GroupedLinear(experts, ffn, hidden, bias=True, dtype=dtype),
            fo.Scale(),
        )
    return fo.Sequential(
        fo.GroupedLinear(experts, hidden, 2 * ffn, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(experts, ffn, hidden, dtype=dtype),
    )


def grouped_bound(x, w1, w2, splits: list[int]):
    """The block's GEMMs per expert and nothing else, forward and backward."""
    rows, ffn2, hidden = x.shape[0], w1.shape[1], x.shape[1]
    pre, act = x.new_empty(rows, ffn2), x.new_empty(rows, ffn2 // 2)
    y, d_act, dx = x.new_empty(rows, hidden), x.new_empty(rows, ffn2 // 2), x.new_empty(rows, hidden)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    dy = torch.randn_like(y)
    d_pre = torch.randn_like(pre)
    torch.nn.functional.silu(torch.randn_like(act), inplace=True)

    def run() -> None:
        start = 0
        for g, count in enumerate(splits):
            if count == 0:
                continue
            rows_g = slice(start, start + count)
            torch.mm(x[rows_g], w1[g].t(), out=pre[rows_g])
            torch.mm(act[rows_g], w2[g].t(), out=y[rows_g])
            torch.mm(dy[rows_g], w2[g], out=d_act[rows_g])
            torch.mm(dy[rows_g].t(), act[rows_g], out=dw2[g])
            torch.mm(d_pre[rows_g], w1[g], out=dx[rows_g])
            torch.mm(d_pre[rows_g].t(), x[rows_g], out=dw1[g])
            start += count

    return run


def fused_step(seq: fo.Sequential, kind: str, x, splits, scales):
    args = (splits, splits, scales) if kind == "gptoss" else (splits, scales, splits)

    def run() -> None:
        inputs = x.detach().requires_grad_(True)
        out = seq(inputs, *args)
        out.backward(torch.ones_like(out))

    return run


def time_rounds(variants: dict, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_ in range(rounds + warmup):
        random.Random(round_).shuffle(order)
        for name in order:
            start = time.perf_counter()
            variants[name]()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def report(title: str, times: dict[str, list[float]], base: str) -> None:
    print(title)
    ref = statistics.median(times[base])
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"  {name:28s} median {median * 1e3:9.2f} ms (min {min(values) * 1e3:.2f}, "
            f"max {max(values) * 1e3:.2f})  {median / ref:.3f}x {base}"
        )


def fused_vs_bound(kind: str, experts: int, hidden: int, ffn: int, rows: int, rounds: int) -> None:
    dtype = torch.bfloat16
    seq = block(kind, experts, hidden, ffn, dtype)
    splits = skewed_splits(experts, rows)
    x = torch.randn(rows, hidden, dtype=dtype)
    scales = torch.rand(rows, dtype=torch.float32)
    w1 = seq[0].weight.detach()
    w2 = seq[2].weight.detach()
    variants = {"grouped bound": grouped_bound(x, w1, w2, splits), "fused": fused_step(seq, kind, x, splits, scales)}
    times = time_rounds(variants, rounds)
    title = (
        f"{kind}: {experts} experts, hidden {hidden}, ffn {ffn}, {rows} rows (skewed, "
        f"{splits.count(0)} empty, largest {max(splits)}), bf16, forward+backward"
    )
    report(title, times, "grouped bound")
    print("  plan:", str(seq.last_plan).splitlines()[-1].strip()[:160])


def small_problem(rounds: int) -> None:
    """The CPU backend's one-GEMM path (``small_problem_macs``) against its per-group path."""
    from fusible_ops.kernels import get_backend

    backend = get_backend("cpu")
    default = backend.small_problem_macs
    for dtype, rows in ((torch.float32, 512), (torch.bfloat16, 512), (torch.float32, 64)):
        seq = block("fine", 4, 64, 64, dtype)  # bench --small's sizes: within small_problem_macs
        splits = skewed_splits(4, rows)
        x = torch.randn(rows, 64, dtype=dtype)
        scales = torch.rand(rows)
        step = fused_step(seq, "fine", x, splits, scales)

        def with_limit(limit: int, step=step):  # noqa: ANN001 (binds this iteration's step)
            def run() -> None:
                backend.small_problem_macs = limit
                try:
                    step()
                finally:
                    backend.small_problem_macs = default

            return run

        times = time_rounds({"per-group path": with_limit(0), "one-GEMM path": with_limit(default)}, rounds * 10)
        title = f"small problem: 4 experts, hidden 64, ffn 64, {rows} rows, {dtype}, forward+backward"
        report(title, times, "per-group path")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sections", default="fine,gptoss,small")
    args = parser.parse_args()
    torch.manual_seed(0)
    sections = args.sections.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if "fine" in sections:
        fused_vs_bound("fine", 64, 1024, 512, 8192, args.rounds)
    if "gptoss" in sections:
        fused_vs_bound("gptoss", 32, 1024, 1024, 8192, args.rounds)
    if "small" in sections:
        small_problem(args.rounds)


if __name__ == "__main__":
    main()
