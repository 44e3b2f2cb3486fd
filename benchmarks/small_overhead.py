"""Where the time of a tiny expert block goes: the library's per-call Python vs its kernels.

Run: ``python benchmarks/small_overhead.py [--dtype bfloat16] [--rounds 300]``

At ``bench --small``'s shape (4 experts, hidden 64, ffn 64, 64 rows) the GEMMs take
tens of microseconds, so what a call does in Python shows. Three variants run
interleaved, round by round, in a fresh random order each round (see
``bench.time_interleaved``), on the same weights and inputs (medians reported, with
ratios to the composition):

- ``composition``: the torchtitan-style ``torch._grouped_mm`` block, autograd;
- ``fused``: ``fo.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)``, the
  GroupedMLP plan (everything the library does per call);
- ``kernels only``: one minimal ``autograd.Function`` calling the same CPU backend
  entry points the fused op calls (argument checks included), with no fuser, plan,
  op contexts or signature: the floor the library's own Python sits on.

``fused`` minus ``kernels only`` is the per-call Python of the fuser, its autograd
Function and the fused op.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusible_ops.cli import bench  # noqa: E402
from fusible_ops.kernels import get_backend  # noqa: E402
from fusible_ops.kernels import library as kernel_ops  # noqa: E402
from fusible_ops.kernels.activation import ActivationSpec  # noqa: E402

SWIGLU = ActivationSpec("swiglu")


class KernelsOnly(torch.autograd.Function):
    """fc1 -> SwiGLU * probs -> fc2 on the ``cpu`` backend, nothing else."""

    @staticmethod
    def forward(ctx, x, split_sizes, probs, w1, w2):
        kernels = get_backend("cpu")
        host = split_sizes.tolist()
        offsets = torch.cumsum(split_sizes, 0, dtype=torch.int32)
        pre, y = kernel_ops._mlp_forward_impl(
            kernels, x, w1, None, w2, None, probs, host, offsets, SWIGLU, False, None
        )
        ctx.save_for_backward(x, pre, probs, offsets, w1, w2)
        ctx.host = host
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, pre, probs, offsets, w1, w2 = ctx.saved_tensors
        needs = (True, True, False, True, False, True)
        grads = kernel_ops._mlp_backward_impl(
            get_backend("cpu"),
            grad_y,
            x,
            pre,
            w1,
            w2,
            None,
            probs,
            ctx.host,
            offsets,
            SWIGLU,
            False,
            needs,
            None,
        )
        return grads[0], None, grads[5], grads[1], grads[3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    p = bench.make_problem(bench.SMALL_SHAPE, getattr(torch, args.dtype), torch.device("cpu"))
    x = p.x.detach().requires_grad_(True)
    probs = p.probs.detach().requires_grad_(True)
    forwards = {
        "composition": lambda: bench.grouped_mm_forward(p, x, probs),
        "fused": lambda: p.experts(x, p.splits_tensor, probs, p.splits_tensor),
        "kernels only": lambda: KernelsOnly.apply(x, p.splits_tensor, probs, p.w1, p.w2),
    }
    reference = forwards["composition"]()
    for name, forward in forwards.items():  # same math before timing anything
        torch.testing.assert_close(forward(), reference, rtol=2e-2, atol=2e-2, msg=name)
    times: dict[tuple[str, str], list[float]] = {}
    for order in bench.shuffled_rounds(list(forwards), args.rounds):  # a fresh order each round
        for name in order:
            forward = forwards[name]
            start = time.perf_counter()
            y = forward()
            middle = time.perf_counter()
            y.backward(p.grad_y)
            end = time.perf_counter()
            times.setdefault((name, "forward"), []).append(middle - start)
            times.setdefault((name, "forward+backward"), []).append(end - start)
    print(
        f"{bench.SMALL_SHAPE}, {args.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds (medians)"
    )
    for mode in ("forward", "forward+backward"):
        base = statistics.median(times[("composition", mode)])
        print(f"[{mode}]")
        for name in forwards:
            median = statistics.median(times[(name, mode)])
            print(f"  {name:14s} {median * 1e6:8.1f} us  {median / base:5.2f}x composition")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
