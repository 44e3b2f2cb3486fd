"""The fuser's fast path against the general path, timed at large CPU shapes.

The same fused expert block, split sizes given as a tensor (what the fast path takes),
forward+backward (float32 by default: bf16 GEMMs are slow on CPUs without AMX): each round times a call with the fast path and one with it
disabled (the general path: signature, op contexts, the public kernel entry points), in
a shuffled order; medians with min and max. At these shapes the GEMMs dominate, so the
two should tie: the fast path only removes per-call Python.

    python benchmarks/fast_path_ab.py [--rounds 10] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_shapes import block, report, skewed_splits, time_rounds  # noqa: E402

from fusible_ops.fuser import operation_fuser  # noqa: E402

SHAPES = {
    "bench default (8 experts, hidden 1024, ffn 1408, 8192 rows, even)": (8, 1024, 1408, 8192, False),
    "fine-grained (64 experts, hidden 1024, ffn 512, 8192 rows, skewed)": (64, 1024, 512, 8192, True),
}


def step(seq, x, splits, scales, fast: bool):  # noqa: ANN001, ANN201
    fuser = seq._get_groups()[0][1]

    def call() -> None:
        inputs = x.detach().requires_grad_(True)
        out = seq(inputs, splits, scales, splits)
        out.backward(torch.ones_like(out))

    def general() -> None:  # no fast call is used or made: the call takes the general path
        original, kept = operation_fuser.fast_call_of, fuser._fast_index
        operation_fuser.fast_call_of, fuser._fast_index = (lambda *args: None), {}
        try:
            call()
        finally:
            operation_fuser.fast_call_of, fuser._fast_index = original, kept

    return call if fast else general


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for title, (experts, hidden, ffn, rows, skewed) in SHAPES.items():
        dtype = getattr(torch, args.dtype)
        seq = block("fine", experts, hidden, ffn, dtype)
        sizes = skewed_splits(experts, rows) if skewed else [rows // experts] * experts
        splits = torch.tensor(sizes)
        x = torch.randn(rows, hidden, dtype=dtype)
        scales = torch.rand(rows)
        fused = step(seq, x, splits, scales, fast=True)
        for _ in range(3):  # the fast call is in place from the third call on
            fused()
        fuser = seq._get_groups()[0][1]
        assert fuser._fast_index, f"no fast call: {list(fuser._fast_calls._entries.values())}"
        variants = {"general path": step(seq, x, splits, scales, fast=False), "fast path": fused}
        report(f"{title}, {args.dtype}, forward+backward", time_rounds(variants, args.rounds), "general path")


if __name__ == "__main__":
    main()
