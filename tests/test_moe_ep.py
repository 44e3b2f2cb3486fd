"""Expert parallelism over gloo on CPU: 2 and 4 processes spawned by the test.

Each rank holds different tokens (uneven counts, one rank with none, one expert that no
token picks). The EP MoE, loaded with the same global weights, must equal the
single-process MoE run on all ranks' tokens: outputs and input gradients of this
rank's tokens, this rank's expert weight gradients, and the router gradient summed
over ranks.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fusible_ops as fo
from fusible_ops import MoE
from fusible_ops.checkpoint import export_stacked, load_stacked
from fusible_ops.moe import permute, topk_route, unpermute
from fusible_ops.moe.expert_parallel import ExpertParallel

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)

HIDDEN, FFN, NUM_EXPERTS = 6, 5, 8
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_tokens(counts: list[int]) -> torch.Tensor:
    """All ranks' tokens; feature 0 is positive so the last expert is never chosen."""
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(sum(counts), HIDDEN, dtype=torch.float64, generator=gen)
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _init_weights(moe, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=gen) * 0.5)
        moe.router.weight[-1].zero_()
        moe.router.weight[-1, 0] = -30.0  # with x[:, 0] >= 1 this expert never makes the top-k


def _standin_experts(rows, split_sizes, probs, w1, w2):
    """A plain-PyTorch SwiGLU expert block with the Sequential's calling convention."""
    outs, start = [], 0
    for g, n in enumerate(split_sizes):
        h = rows[start : start + n] @ w1[g].T
        outs.append(
            (torch.nn.functional.silu(h[:, :FFN]) * h[:, FFN:] * probs[start : start + n, None]) @ w2[g].T
        )
        start += n
    return torch.cat(outs)


def _check_transport(rank, world, counts, offset, x_all, grad_all):
    """ExpertParallel dispatch/combine with stand-in experts against the same math on one rank."""
    gen = torch.Generator().manual_seed(7)
    router = torch.randn(NUM_EXPERTS, HIDDEN, dtype=torch.float64, generator=gen)
    router[-1] = 0
    router[-1, 0] = -30.0
    w1 = torch.randn(NUM_EXPERTS, 2 * FFN, HIDDEN, dtype=torch.float64, generator=gen)
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, FFN, dtype=torch.float64, generator=gen)

    ref_x, ref_w1, ref_w2 = (t.clone().requires_grad_() for t in (x_all, w1, w2))
    probs, ids = topk_route(ref_x @ router.T, 2)
    perm = permute(ref_x, ids, NUM_EXPERTS, probs)
    rows_out = _standin_experts(perm.rows, perm.split_sizes.tolist(), perm.probs, ref_w1, ref_w2)
    ref = unpermute(rows_out, perm.token_index, ref_x.shape[0])
    (ref * grad_all).sum().backward()

    ep = ExpertParallel(NUM_EXPERTS)
    local = slice(ep.local_expert_range.start, ep.local_expert_range.stop)
    mine = slice(offset, offset + counts[rank])
    x, lw1, lw2 = (t.clone().requires_grad_() for t in (x_all[mine], w1[local], w2[local]))
    probs, ids = topk_route(x @ router.T, 2)
    rows, row_probs, state = ep.dispatch(x, ids, probs)
    out = ep.combine(_standin_experts(rows, state.local_split_sizes, row_probs, lw1, lw2), state)
    (out * grad_all[mine]).sum().backward()
    torch.testing.assert_close(out, ref[mine].detach())
    torch.testing.assert_close(x.grad, ref_x.grad[mine])
    torch.testing.assert_close(lw1.grad, ref_w1.grad[local])
    torch.testing.assert_close(lw2.grad, ref_w2.grad[local])


def _check_moe(rank, world, counts, offset, x_all, grad_all, bias, score):
    ref = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, bias=bias, score=score, dtype=torch.float64)
    _init_weights(ref, seed=11)
    ep_moe = MoE(
        HIDDEN, FFN, NUM_EXPERTS, 2, bias=bias, score=score, dtype=torch.float64, ep_group=dist.group.WORLD
    )
    assert ep_moe.experts[0].weight.shape[0] == NUM_EXPERTS // world
    assert isinstance(ep_moe.experts, fo.Sequential)
    ep_moe.router.load_state_dict(ref.router.state_dict())
    global_weights = export_stacked(ref)
    load_stacked(ep_moe, **global_weights)  # each rank copies only its experts

    ref_x = x_all.clone().requires_grad_()
    ref_out = ref(ref_x)
    (ref_out * grad_all).sum().backward()

    # spy: fc2 must write into the very tensor the return all-to-all sends
    ep, seen = ep_moe.expert_parallel, {}
    make_buffer, combine = ep.output_buffer, ep.combine
    ep.output_buffer = lambda *a, **k: seen.setdefault("buffer", make_buffer(*a, **k))
    ep.combine = lambda y, state, **k: combine(seen.setdefault("sent", y), state, **k)

    mine = slice(offset, offset + counts[rank])
    x = x_all[mine].clone().requires_grad_()
    out = ep_moe(x)
    assert seen["sent"].data_ptr() == seen["buffer"].data_ptr()
    assert seen["sent"].shape == seen["buffer"].shape
    (out * grad_all[mine]).sum().backward()

    torch.testing.assert_close(out, ref_out[mine].detach())
    torch.testing.assert_close(x.grad, ref_x.grad[mine])
    local = slice(rank * (NUM_EXPERTS // world), (rank + 1) * (NUM_EXPERTS // world))
    for i in (0, 2):
        for name in ("weight", "bias") if bias else ("weight",):
            got = getattr(ep_moe.experts[i], name).grad
            want = getattr(ref.experts[i], name).grad[local]
            torch.testing.assert_close(
                got, want, msg=lambda m, i=i, name=name: f"experts[{i}].{name}.grad: {m}"
            )
    assert torch.count_nonzero(ref.experts[0].weight.grad[-1]) == 0  # the unused expert
    gathered = export_stacked(ep_moe, gather=True)  # export back: every rank gets the global tensors
    assert gathered.keys() == global_weights.keys()
    assert all(torch.equal(gathered[k], global_weights[k]) for k in gathered)
    router_grad = ep_moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    torch.testing.assert_close(router_grad, ref.router.weight.grad)


def _check_autocast(rank, counts, offset, x_all):
    """Under autocast fc2 computes in bf16: the send buffer must be allocated in bf16 too."""
    moe = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, ep_group=dist.group.WORLD)
    x = x_all[offset : offset + counts[rank]].float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    out.float().square().sum().backward()
    assert out.shape == x.shape and x.grad is not None


def _check_grad_on_one_rank_only(rank, counts, offset, x_all):
    """A frozen MoE where only rank 0's input needs grad: every rank still joins backward."""
    moe = MoE(HIDDEN, FFN, NUM_EXPERTS, 2, dtype=torch.float64, ep_group=dist.group.WORLD)
    moe.requires_grad_(False)
    x = x_all[offset : offset + counts[rank]].clone().requires_grad_(rank == 0)
    out = moe(x)
    out.sum().backward()  # would hang rank 0 (or fail on the others) without the anchor
    assert (x.grad is not None) == (rank == 0)


def _worker(rank: int, world: int, port: int, counts: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x_all = _global_tokens(counts)
        grad_all = torch.randn(x_all.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        offset = sum(counts[:rank])
        with pytest.raises(ValueError, match="not divisible"):
            MoE(HIDDEN, FFN, NUM_EXPERTS + 1, 2, ep_group=dist.group.WORLD)
        _check_transport(rank, world, counts, offset, x_all, grad_all)
        _check_moe(rank, world, counts, offset, x_all, grad_all, bias=False, score="softmax")
        _check_moe(rank, world, counts, offset, x_all, grad_all, bias=True, score="sigmoid")
        _check_autocast(rank, counts, offset, x_all)
        _check_grad_on_one_rank_only(rank, counts, offset, x_all)
    finally:
        dist.destroy_process_group()


def _spawn(world: int, counts: list[int], worker=None) -> None:
    """Run ``worker(rank, world, port, counts)`` (default: this file's checks) on ``world`` processes."""
    # forkserver: workers fork from a fresh server that imported torch once, so they start
    # fast and inherit no state (threads, process groups) from the pytest process.
    if "forkserver" in mp.get_all_start_methods():
        method = "forkserver"
        mp.get_context(method).set_forkserver_preload(["torch", "fusible_ops"])
    else:
        method = "spawn"
    context = mp.start_processes(
        worker or _worker, args=(world, _free_port(), counts), nprocs=world, join=False, start_method=method
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"expert-parallel workers (world={world}) did not finish within {TIMEOUT_S} s")


@pytest.mark.numerics
@pytest.mark.parametrize(
    "world, counts",
    [(2, [9, 0]), (4, [3, 0, 7, 1])],
    ids=["2proc-rank1-empty", "4proc-uneven"],
)
def test_expert_parallel_matches_single_process(world, counts):
    _spawn(world, counts)
