"""MoE layer forward+backward: single process vs expert parallelism over 2 gloo processes (CPU).

Informational: both are measured in one run on the same global batch. The single
process holds all experts and all tokens; with EP=2 each rank holds half of the
experts and half of the tokens, and a step's time is the slower rank's.

    python -m fusible_ops.cli.moe_ep_bench --tokens 512 --hidden 256 --ffn 512 --experts 8 --top-k 2
    python -m fusible_ops bench --moe-ep      (adds this row to the bench table)
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _step_ms(
    moe: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, warmup: int, iters: int, *, sync: bool
) -> list[float]:
    """Per-step ms of forward+backward; ``sync`` starts every step with a barrier (EP runs)."""
    times = []
    for i in range(warmup + iters):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        x.grad = None
        out = moe(x)
        out.backward(grad)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _worker(rank: int, world: int, port: int, cfg: dict, results: dict) -> None:
    from fusible_ops.moe.checkpoint import export_stacked, load_stacked
    from fusible_ops.moe.layer import MoE

    torch.set_num_threads(cfg["threads_per_rank"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        dims = (cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"])
        dtype = getattr(torch, cfg["dtype"])
        full = MoE(*dims, dtype=dtype)
        x_all = torch.randn(cfg["tokens"], cfg["hidden"], dtype=dtype)
        grad_all = torch.randn_like(x_all)
        if rank == 0:
            torch.set_num_threads(cfg["threads_per_rank"] * world)  # the single process gets every core
            single = _step_ms(
                full, x_all.clone().requires_grad_(), grad_all, cfg["warmup"], cfg["iters"], sync=False
            )
            torch.set_num_threads(cfg["threads_per_rank"])
        dist.barrier()

        ep = MoE(*dims, dtype=dtype, ep_group=dist.group.WORLD)
        ep.router.load_state_dict(full.router.state_dict())
        load_stacked(ep, **export_stacked(full))
        mine = x_all.chunk(world)[rank]
        ep_times = torch.tensor(
            _step_ms(
                ep,
                mine.clone().requires_grad_(),
                grad_all.chunk(world)[rank],
                cfg["warmup"],
                cfg["iters"],
                sync=True,
            )
        )
        dist.all_reduce(ep_times, op=dist.ReduceOp.MAX)
        if rank == 0:
            results["single_ms"] = statistics.median(single)
            results["ep2_ms"] = statistics.median(ep_times.tolist())
    finally:
        dist.destroy_process_group()


def run_moe_ep_bench(
    tokens: int = 512,
    hidden: int = 256,
    ffn: int = 512,
    experts: int = 8,
    top_k: int = 2,
    *,
    dtype: str = "float32",
    warmup: int = 3,
    iters: int = 10,
    threads_per_rank: int = 1,
) -> dict[str, float]:
    """Median ms of one MoE forward+backward: ``{"single_ms": ..., "ep2_ms": ...}``."""
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = dict(
        tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, dtype=dtype,
        warmup=warmup, iters=iters, threads_per_rank=threads_per_rank,
    )  # fmt: skip
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, port, cfg, results), nprocs=world)
        return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    r = run_moe_ep_bench(
        args.tokens, args.hidden, args.ffn, args.experts, args.top_k, dtype=args.dtype, iters=args.iters
    )
    print(
        f"MoE fwd+bwd (tokens={args.tokens}, hidden={args.hidden}, ffn={args.ffn}, experts={args.experts}, "
        f"top_k={args.top_k}, {args.dtype}, CPU gloo)"
    )
    print(f"  single process (2 threads): {r['single_ms']:8.2f} ms (median of {args.iters})")
    print(f"  EP=2 (1 thread per rank)  : {r['ep2_ms']:8.2f} ms (median of {args.iters}, slower rank)")
    print(f"  EP=2 / single             : {r['ep2_ms'] / r['single_ms']:8.2f}x")


if __name__ == "__main__":
    main()
