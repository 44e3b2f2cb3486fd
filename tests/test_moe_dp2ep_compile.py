"""The dp2ep recipe of docs/moe.md with selective activation checkpointing and
``block.compile()``: EP=2 x FSDP2=2 on 4 gloo processes (CPU).

Every rank compiles its block with ``fullgraph=True`` and no graph break, one graph that
holds the checkpointed region; the compiled block trains side by side with the same
recipe run eagerly: losses, global gradients and the routing statistics agree within
the rounding-error model, and both equal a one-process float64 reference at the first
step (which checks the one-unit sharding of ``expert_shard_placement`` and the expert
gradient rule).
"""

from __future__ import annotations

from functools import partial

import pytest
import test_moe_ep
import torch
import torch.distributed as dist
from error_model import BOTH_SIDES, rounding_rtol
from test_moe_dtensor import _FORWARD_TERMS, _GRAD_TERMS, TOKENS, _batch, _reference
from test_moe_ep import HIDDEN, _spawn
from torch import nn

import fusible_ops as fo
from fusible_ops import MoE
from fusible_ops.checkpoint import export_stacked, load_stacked


def _has_per_parameter_mesh() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
    pytest.mark.skipif(not _has_per_parameter_mesh(), reason="fully_shard takes no per-parameter mesh"),
]

WORLD, EP = 4, 2
STEPS = 3
LR = 1e-2
# the MoE's chain (test_moe_dtensor), plus the block's RMSNorm (a mean over HIDDEN forward
# and back, and its weight gradient's sum over the tokens) and the residual sum
GRAD_RTOL = rounding_rtol(torch.float32, _GRAD_TERMS + 2 * HIDDEN + TOKENS, condition=4)
LOSS_RTOL = rounding_rtol(torch.float32, 2 * (_FORWARD_TERMS + HIDDEN + 2) + TOKENS * HIDDEN + 4, condition=4)


class Block(nn.Module):
    """The MoE half of a transformer block: ``x + moe(norm(x))``."""

    def __init__(self, moe: MoE, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN, dtype=dtype)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


def _reference_block() -> Block:
    block = Block(_reference(bias=True), torch.float64)
    with torch.no_grad():
        block.norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3)))
    return block


def _recipe_block(ref: Block, world_mesh, dp_ep_mesh) -> tuple[nn.Module, MoE]:
    """docs/moe.md's dp2ep recipe with SAC, before ``compile``: one FSDP2 unit per block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from fusible_ops.moe import expert_shard_placement

    moe = MoE(HIDDEN, test_moe_ep.FFN, test_moe_ep.NUM_EXPERTS, 2, bias=True, ep_mesh=world_mesh["ep"])
    moe.router.load_state_dict(ref.moe.router.state_dict())  # copies into float32
    load_stacked(moe, **{name: t.float() for name, t in export_stacked(ref.moe).items()})
    inner = Block(moe, torch.float32)
    inner.norm.load_state_dict(ref.norm.state_dict())
    policy = fo.sac_policy([torch.ops.aten.mm.default])  # save the GEMMs, the experts' included
    block = checkpoint_wrapper(inner, context_fn=partial(create_selective_checkpoint_contexts, policy))
    fully_shard(block, mesh=dp_ep_mesh, shard_placement_fn=expert_shard_placement(block, world_mesh["dp"]))
    return block, moe


def _step(block: nn.Module, moe: MoE, x: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """A sum loss over the global batch; FSDP's averaging undone (x world), then the expert
    rule (x 1 / ep), so the gradients are the global batch's; returns the global loss."""
    loss = block(x).square().sum()
    loss.backward()
    with torch.no_grad():
        for p in block.parameters():
            p.grad.mul_(WORLD)
    moe.scale_expert_gradients()
    grads = {name: p.grad.full_tensor() for name, p in block.named_parameters()}
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total), grads


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """Within ``rtol`` of the largest entry of ``want`` (random data: condition counted)."""
    return float((got.double() - want.double()).abs().max()) <= rtol * float(want.abs().max())


def _check_expert_shard_placement_errors(world_mesh) -> None:
    from fusible_ops.moe import expert_shard_placement

    ep_moe = MoE(HIDDEN, test_moe_ep.FFN, test_moe_ep.NUM_EXPERTS, 2, ep_mesh=world_mesh["ep"])
    with pytest.raises(ValueError, match=r"^expert_shard_placement: dp_mesh must be a 1-D DeviceMesh"):
        expert_shard_placement(ep_moe, world_mesh)
    with pytest.raises(ValueError, match=r"^expert_shard_placement: Linear holds no fusible_ops.MoE"):
        expert_shard_placement(nn.Linear(2, 2), world_mesh["dp"])
    plain = Block(MoE(HIDDEN, test_moe_ep.FFN, test_moe_ep.NUM_EXPERTS, 2), torch.float32)
    with pytest.raises(ValueError, match=r"^expert_shard_placement: the MoE 'moe' has no ep_mesh"):
        expert_shard_placement(plain, world_mesh["dp"])
    place = expert_shard_placement(ep_moe, world_mesh["dp"])
    assert place(ep_moe.router.weight) is None and place(ep_moe.experts[0].weight).placement.dim == 0


def _worker(rank: int, world: int, port: int, _args) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch._dynamo.config.capture_scalar_outputs = True  # token counts per expert
    counters.clear()
    try:
        world_mesh = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("dp", "ep"))
        dp_ep_mesh = world_mesh["dp", "ep"]._flatten("dp_ep")
        _check_expert_shard_placement_errors(world_mesh)
        ref = _reference_block()
        eager, eager_moe = _recipe_block(ref, world_mesh, dp_ep_mesh)
        block, moe = _recipe_block(ref, world_mesh, dp_ep_mesh)
        counter = CompileCounterWithBackend("aot_eager")
        block.compile(backend=counter, fullgraph=True)
        weight = moe.experts[0].weight  # the experts' own dp mesh: (_StridedShard(0), Shard(0))
        assert weight.device_mesh.ndim == 2 and all(p.dim == 0 for p in weight.placements), weight.placements
        assert moe.router.weight.device_mesh.ndim == 1, moe.router.weight.device_mesh

        eager_opt = torch.optim.SGD(eager.parameters(), lr=LR)
        opt = torch.optim.SGD(block.parameters(), lr=LR)
        rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
        for step in range(STEPS):
            x = _batch(step)[rows].float()
            want_loss, want_grads = _step(eager, eager_moe, x)
            loss, grads = _step(block, moe, x)
            slack = BOTH_SIDES * (1 + step)  # both round; an earlier step's rounding stays in the weights
            assert abs(loss - want_loss) <= slack * LOSS_RTOL * abs(want_loss), (step, loss, want_loss)
            for name, grad in grads.items():
                assert _close(grad, want_grads[name], slack * GRAD_RTOL), (step, name)
            load = moe.last_expert_load  # recorded inside the compiled, checkpointed region
            assert torch.equal(load, eager_moe.last_expert_load), (step, load)
            assert int(load.sum()) == x.shape[0] * moe.top_k, load
            if step == 0:
                ref_x = _batch(0).requires_grad_()
                ref(ref_x).square().sum().backward()
                for name, p in ref.named_parameters():  # checkpoint_wrapper keeps the names
                    assert _close(grads[name], p.grad, GRAD_RTOL), name
                    assert _close(want_grads[name], p.grad, GRAD_RTOL), name
            for optimizer in (eager_opt, opt):
                optimizer.step()
                optimizer.zero_grad()

        # every rank: one graph over the steps, no break, the checkpointed region inside it
        assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
        assert counter.frame_count == 1 and counters["stats"]["unique_graphs"] == 1, counter.frame_count
        targets = {node.target for node in counter.graphs[0].graph.nodes if node.op == "call_function"}
        assert torch.ops.higher_order.tag_activation_checkpoint in targets, targets
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _compile_timeout(monkeypatch):
    monkeypatch.setattr(test_moe_ep, "TIMEOUT_S", 600)  # compiling takes a while on 2 cores


@pytest.mark.numerics
def test_dp2ep_compiled_block_with_sac_has_no_graph_break_and_equals_eager():
    _spawn(WORLD, None, worker=_worker)
