"""Expert parallelism under ``torch.compile(fullgraph=True)``: 2 and 4 gloo processes on CPU.

``fo.MoE(ep_mesh=...)`` compiled with a full graph must equal the eager layer (outputs,
input and parameter gradients) over several routings, and equal an independently written
plain-PyTorch EP layer built on torch's functional collectives; both may compile at most
twice over those routings (a first graph, then one with dynamic token counts).
"""

from __future__ import annotations

import pytest
import test_moe_ep
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from test_moe_ep import _spawn

from fusible_ops import MoE

H, F = 6, 5
STEPS = 10


class PlainEPMoE(torch.nn.Module):
    """A softmax top-k SwiGLU MoE over EP with functional collectives, written from scratch:
    the experts are a dense loop over local experts with a row mask (no split sizes)."""

    def __init__(self, router: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, top_k: int) -> None:
        super().__init__()
        self.router = torch.nn.Parameter(router.clone())
        self.w1, self.w2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, world = dist.group.WORLD, dist.get_world_size()
        num_local = self.w1.shape[0]
        scores = torch.softmax(x @ self.router.T, dim=-1)
        probs, ids = torch.topk(scores, self.top_k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        order = torch.argsort(ids.reshape(-1), stable=True)
        ids_sorted = ids.reshape(-1)[order]
        counts = torch.zeros(world, dtype=torch.long).scatter_add_(
            0, ids_sorted // num_local, torch.ones_like(ids_sorted)
        )
        recv = funcol.all_to_all_single(counts, None, None, group)
        splits = torch.cat([counts, recv]).tolist()
        send, got = splits[:world], splits[world:]
        for s in splits:
            torch._check(s >= 0)
        send[-1] = ids_sorted.shape[0] - sum(send[:-1])
        rows = funcol.all_to_all_single_autograd(x[order // self.top_k], got, send, group)
        row_probs = funcol.all_to_all_single_autograd(probs.reshape(-1)[order], got, send, group)
        row_ids = funcol.all_to_all_single(ids_sorted, got, send, group) % num_local
        out = torch.zeros_like(rows)
        for j in range(num_local):
            h = rows @ self.w1[j].T
            y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ self.w2[j].T
            out = out + y * (row_probs * (row_ids == j))[:, None]
        back = funcol.all_to_all_single_autograd(out, send, got, group)
        return torch.zeros_like(x).index_add(0, order // self.top_k, back)


def _counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("aot_eager")


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()]


def _step(module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = module(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad


def _worker(rank: int, world: int, port: int, counts: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch._dynamo.config.capture_scalar_outputs = True
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"]
        num_experts = 2 * world
        torch.manual_seed(0)  # same router on every rank; the experts differ by rank anyway
        eager = MoE(H, F, num_experts, 2, dtype=torch.float64, ep_mesh=mesh)
        moe = MoE(H, F, num_experts, 2, dtype=torch.float64, ep_mesh=mesh)
        moe.load_state_dict(eager.state_dict())
        local_w1, local_w2 = (moe.experts[i].weight.to_local().detach() for i in (0, 2))
        plain = PlainEPMoE(moe.router.weight.detach(), local_w1, local_w2, 2)
        compiled_counter, plain_counter = _counter(), _counter()
        compiled = torch.compile(moe, backend=compiled_counter, fullgraph=True)
        compiled_plain = torch.compile(plain, backend=plain_counter, fullgraph=True)
        for step in range(STEPS):
            x = torch.randn(
                counts[rank], H, dtype=torch.float64, generator=torch.Generator().manual_seed(step)
            )
            for module in (eager, moe, plain):
                module.zero_grad()
            want, want_dx = _step(eager, x)
            got, got_dx = _step(compiled, x)
            plain_out, plain_dx = _step(compiled_plain, x)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got_dx, want_dx)
            for a, b in zip(_grads(moe), _grads(eager)):
                torch.testing.assert_close(a, b)
            torch.testing.assert_close(got, plain_out)
            torch.testing.assert_close(got_dx, plain_dx)
            plain_grads = _grads(plain)
            torch.testing.assert_close(_grads(moe)[1], plain_grads[1])  # experts[0] vs w1
            torch.testing.assert_close(_grads(moe)[2], plain_grads[2])
        assert compiled_counter.frame_count <= 2, compiled_counter.frame_count
        assert plain_counter.frame_count <= 2, plain_counter.frame_count
        if world == 2:
            _check_frozen_layer(rank, mesh, counts)
    finally:
        dist.destroy_process_group()


def _check_frozen_layer(rank: int, mesh, counts: list[int]) -> None:
    """A frozen layer where only rank 0's input needs grad: every rank joins backward."""
    moe = MoE(H, F, 4, 2, dtype=torch.float64, ep_mesh=mesh).requires_grad_(False)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    x = torch.randn(counts[rank], H, dtype=torch.float64).requires_grad_(rank == 0)
    want = moe(x)
    out = compiled(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert (x.grad is not None) == (rank == 0)


@pytest.fixture(autouse=True)
def _compile_timeout(monkeypatch):
    monkeypatch.setattr(test_moe_ep, "TIMEOUT_S", 600)  # compiling takes a while on 2 cores


def test_compiled_expert_parallel_matches_eager_2proc():
    _spawn(2, [7, 3], worker=_worker)


def test_compiled_expert_parallel_matches_eager_4proc():
    _spawn(4, [3, 0, 5, 2], worker=_worker)
