"""dp2ep with selective activation checkpointing, eager vs ``block.compile()`` (CPU, gloo).

Run: ``python benchmarks/moe_dp2ep_compile.py [--backend aot_eager|inductor] [--steps 10]
[--tokens 256 --hidden 128 --ffn 256 --experts 8 --top-k 2]``

Spawns 4 processes (dp=2 x ep=2) that each build docs/moe.md's dp2ep recipe with SAC
(``x + moe(norm(x))`` per block, one FSDP2 unit per block through
``expert_shard_placement``) twice: one run eagerly, one with ``block.compile(fullgraph=True)``.
Prints, from every rank: graph breaks and graphs compiled; and the time of the first
compiled step (compilation included) and the median step time (forward, backward,
expert-gradient scaling, SGD step; the slowest rank per step) of both.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Block(torch.nn.Module):
    """The MoE half of a transformer block: ``x + moe(norm(x))``."""

    def __init__(self, moe: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


def _block(args, world_mesh, dp_ep):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    import fusible_ops as fo
    from fusible_ops.moe import expert_shard_placement

    torch.manual_seed(0)
    moe = fo.MoE(args.hidden, args.ffn, args.experts, args.top_k, ep_mesh=world_mesh["ep"])
    policy = fo.sac_policy([torch.ops.aten.mm.default])
    block = checkpoint_wrapper(
        Block(moe, args.hidden), context_fn=partial(create_selective_checkpoint_contexts, policy)
    )
    fully_shard(block, mesh=dp_ep, shard_placement_fn=expert_shard_placement(block, world_mesh["dp"]))
    return block, moe


def _slowest(seconds: float) -> float:
    value = torch.tensor(seconds)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _run(block, moe, x: torch.Tensor, steps: int) -> list[float]:
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        block(x).float().square().mean().backward()
        moe.scale_expert_gradients()
        opt.step()
        opt.zero_grad()
        times.append(_slowest(time.perf_counter() - start))
    return times


def _worker(rank: int, world: int, port: int, args) -> None:
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch._dynamo.config.capture_scalar_outputs = True
    try:
        world_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
        dp_ep = world_mesh["dp", "ep"]._flatten("dp_ep")
        x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
        eager = _run(*_block(args, world_mesh, dp_ep), x, args.steps + 1)[1:]
        block, moe = _block(args, world_mesh, dp_ep)
        block.compile(backend=args.backend, fullgraph=True)
        compiled = _run(block, moe, x, args.steps + 1)
        breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        for turn in range(world):  # in rank order
            if turn == rank:
                print(f"rank {rank}: graph breaks {breaks}, graphs {graphs}", flush=True)
            dist.barrier()
        if rank == 0:
            print(
                f"backend {args.backend}, {world} ranks (dp=2 x ep=2), {args.tokens} tokens/rank, "
                f"hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, top-{args.top_k}\n"
                f"first compiled step (compilation included): {compiled[0]:.2f} s\n"
                f"median step over {args.steps}: eager {1e3 * statistics.median(eager):.1f} ms, "
                f"compiled {1e3 * statistics.median(compiled[1:]):.1f} ms",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(4, port, args), nprocs=4, start_method="spawn")


if __name__ == "__main__":
    main()
