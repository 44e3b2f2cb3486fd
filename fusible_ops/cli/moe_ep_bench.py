"""MoE layer forward+backward: single process vs expert parallelism over 2 gloo processes (CPU).

Informational: both are measured in one run on the same global batch. The single
process holds all experts and all tokens and uses every thread it is given; with EP=2
each rank holds half of the experts and half of the tokens and gets an equal share of
those threads, and a step's time is the slower rank's. With fewer cores (or threads)
than ranks the ranks take turns on a core, and the result says its numbers are not
trustworthy.

    python -m fusible_ops.cli.moe_ep_bench --tokens 512 --hidden 256 --ffn 512 --experts 8 --top-k 2
    python -m fusible_ops bench --moe-ep      (adds this row to the bench table)
"""

from __future__ import annotations

import argparse
import os
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
            torch.set_num_threads(cfg["threads"])  # the single process gets every thread
            single = _step_ms(
                full, x_all.clone().requires_grad_(), grad_all, cfg["warmup"], cfg["iters"], sync=False
            )
            results["single_threads_used"] = torch.get_num_threads()
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
        results[f"rank{rank}_threads_used"] = torch.get_num_threads()
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
    threads: int | None = None,
) -> dict:
    """Median ms of one MoE forward+backward, single process and EP=2.

    Args:
        threads: CPU threads in all (default: ``torch.get_num_threads()``); the single
            process uses all of them, each EP rank ``threads // 2`` (at least 1).

    Returns:
        ``{"single_ms", "ep2_ms", "threads", "threads_per_rank", "cores", "warnings"}``;
        ``warnings`` says why the figures are not trustworthy, if they are not.
    """
    world = 2
    threads = torch.get_num_threads() if threads is None else threads
    if threads < 1:
        raise ValueError(f"run_moe_ep_bench: threads must be >= 1, got {threads}")
    threads_per_rank = max(1, threads // world)
    cores = available_cores()
    warnings = trust_warnings(threads, cores, world)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = dict(
        tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, dtype=dtype,
        warmup=warmup, iters=iters, threads=threads, threads_per_rank=threads_per_rank,
    )  # fmt: skip
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, port, cfg, results), nprocs=world)
        measured = dict(results)
    return {**measured, "threads": threads, "threads_per_rank": threads_per_rank, "cores": cores,
            "warnings": warnings}  # fmt: skip


def trust_warnings(threads: int, cores: int, world: int) -> list[str]:
    """Why a run of ``world`` ranks with ``threads`` threads on ``cores`` cores cannot be
    trusted (empty when it can)."""
    if cores < world:
        return [
            f"not trustworthy: {world} ranks share {cores} core(s), so they take turns and the EP "
            "time includes the waiting"
        ]
    if threads < world:
        return [
            f"not trustworthy: {threads} thread(s) for {world} ranks; each rank runs with 1 thread "
            f"({world} in all) against the single process's {threads}"
        ]
    if threads > cores:
        return [f"not trustworthy: {threads} threads on {cores} cores oversubscribe the machine"]
    return []


def available_cores() -> int:
    """CPU cores this process may run on (its affinity where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def format_moe_ep(r: dict) -> list[str]:
    """The result's lines: both times, their ratio, and any warning."""
    lines = [
        f"  single process ({r['threads']} threads): {r['single_ms']:8.2f} ms",
        f"  EP=2 ({r['threads_per_rank']} thread(s) per rank)  : {r['ep2_ms']:8.2f} ms (slower rank)",
        f"  EP=2 / single: {r['ep2_ms'] / r['single_ms']:.2f}x",
    ]
    return lines + [f"  warning: {w}" for w in r["warnings"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads in all (default: torch.get_num_threads())"
    )
    args = parser.parse_args()
    r = run_moe_ep_bench(
        args.tokens, args.hidden, args.ffn, args.experts, args.top_k, dtype=args.dtype, iters=args.iters,
        threads=args.threads,
    )  # fmt: skip
    print(
        f"MoE fwd+bwd (tokens={args.tokens}, hidden={args.hidden}, ffn={args.ffn}, experts={args.experts}, "
        f"top_k={args.top_k}, {args.dtype}, CPU gloo)"
    )
    print(f"  medians of {args.iters} steps")
    print("\n".join(format_moe_ep(r)))


if __name__ == "__main__":
    main()
