"""Activation checkpointing recomputes the MoE's forward in backward: the recomputation
leaves the module's state as one forward left it (aux-free load counts are not doubled)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from error_model import BOTH_SIDES, rounding_rtol
from torch.utils.checkpoint import checkpoint

from fusible_ops import MoE


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_aux_free_moe_counts_each_forward_once(use_reentrant):
    torch.manual_seed(0)
    moe = MoE(8, 6, 4, 2, load_balancing="aux_free", dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    checkpoint(moe, x, use_reentrant=use_reentrant).square().sum().backward()
    assert int(moe.expert_load_since_update.sum()) == 2 * 5 * 2  # tokens x top_k, once
    torch.testing.assert_close(moe.expert_load_since_update, moe.last_expert_load)
    # and a later plain forward still counts
    moe(x.detach())
    assert int(moe.expert_load_since_update.sum()) == 2 * 2 * 5 * 2


def test_checkpointed_moe_gradients_equal_plain_ones():
    torch.manual_seed(0)
    moe = MoE(8, 6, 4, 2, load_balancing="aux_free", dtype=torch.float64)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    moe(x).square().sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    x.grad = None
    checkpoint(moe, x, use_reentrant=False).square().sum().backward()
    for got, expected in zip([x.grad] + [p.grad for p in moe.parameters()], want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_compiled_checkpointed_moe_records_its_statistics_without_a_graph_break():
    """Under torch.compile(fullgraph=True) inside a selectively checkpointed region (a
    higher-order op that refuses Python side effects), the statistics are still recorded,
    equal to the eager ones; what a caller kept is not changed by a later forward."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    import fusible_ops as fo

    torch.manual_seed(0)
    moe = MoE(8, 6, 4, 2, load_balancing="aux_loss", z_loss_coeff=0.1, capacity_factor=1.0)
    context_fn = partial(create_selective_checkpoint_contexts, fo.sac_policy([torch.ops.aten.mm.default]))

    def region(x):
        return checkpoint(moe, x, use_reentrant=False, context_fn=context_fn)

    x = torch.randn(2, 5, 8, requires_grad=True)
    region(x).square().sum().backward()
    want = (moe.last_expert_load, moe.last_dropped_load, moe.aux_losses)
    assert set(want[2]) == {"load_balancing", "z_loss"} and want[1] is not None
    kept = want[0].clone()
    moe.capacity_factor = None
    moe(x[:1].detach())  # another forward (5 tokens, no capacity): what was kept stays
    assert torch.equal(want[0], kept) and int(moe.last_expert_load.sum()) == 5 * 2
    assert moe.last_dropped_load is None
    moe.capacity_factor = 1.0
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        torch.compile(region, backend=counter, fullgraph=True)(x).square().sum().backward()
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    assert torch.equal(moe.last_expert_load, want[0]) and torch.equal(moe.last_dropped_load, want[1])
    got = moe.aux_losses
    assert got.keys() == want[2].keys()
    # both float32: router logits (8), softmax (4), the loss's sums over tokens (10) and experts (4)
    rtol = BOTH_SIDES * rounding_rtol(torch.float32, 8 + 4 + 10 + 4, condition=4)
    for name, value in want[2].items():
        assert got[name].dtype == torch.float32 and not got[name].requires_grad
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=0)


def test_statistics_keep_their_dtypes_when_the_layer_is_cast():
    moe = MoE(8, 6, 4, 2, load_balancing="aux_loss", dtype=torch.float64)
    moe(torch.randn(5, 8, dtype=torch.float64))
    loss = moe.aux_losses["load_balancing"]
    assert loss.dtype == torch.float64
    moe.to(torch.float32)  # the recorded float64 loss is not rounded by the cast
    assert torch.equal(moe.aux_losses["load_balancing"], loss)
    assert moe.last_expert_load.dtype == torch.long
    assert moe.state_dict().keys() == MoE(8, 6, 4, 2, load_balancing="aux_loss").state_dict().keys()
    assert not any("stat" in key for key in moe.state_dict())  # not saved
