"""torchtitan 0.3's MoE layer with its own experts vs the same layer converted by
``fusible_ops.integrations.torchtitan``: forward+backward time, interleaved rounds in one
process, medians with the spread.

    python benchmarks/torchtitan_experts.py [--rounds 20] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from fusible_ops.integrations import torchtitan as fo_titan

warnings.filterwarnings("ignore", message="In CPU autocast")


def layer(dim: int, hidden: int, experts: int, top_k: int) -> MoE:
    config = MoE.Config(
        num_experts=experts,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=experts, top_k=top_k),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=experts, gate=Linear.Config(in_features=dim, out_features=experts), top_k=top_k
        ),
    )
    torch.manual_seed(0)
    built = config.build()
    with torch.no_grad():
        for param in built.parameters():
            param.normal_(0.0, dim**-0.5)
    return built


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    titan = layer(args.dim, args.hidden, args.experts, args.top_k)
    variants = {"torchtitan (bf16 GEMMs)": titan}
    for name, dtype in (("fusible-ops, compute_dtype=bf16", torch.bfloat16), ("fusible-ops, fp32", None)):
        converted = layer(args.dim, args.hidden, args.experts, args.top_k)
        fo_titan.convert(converted, compute_dtype=dtype)
        variants[name] = converted
    x = torch.randn(1, args.tokens, args.dim)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_ in range(args.rounds + 2):
        random.Random(round_).shuffle(order)
        for name in order:
            inputs = x.clone().requires_grad_(True)
            start = time.perf_counter()
            variants[name](inputs).square().mean().backward()
            if round_ >= 2:  # warm-up rounds
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times[next(iter(variants))])
    print(
        f"{args.tokens} tokens, dim {args.dim}, hidden {args.hidden}, {args.experts} experts, top-{args.top_k}"
    )
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:34s} median {median * 1e3:8.2f} ms  (min {min(values) * 1e3:.2f}, "
            f"max {max(values) * 1e3:.2f})  {median / base:.2f}x torchtitan"
        )


if __name__ == "__main__":
    main()
