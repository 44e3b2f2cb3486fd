"""Activation checkpointing recomputes the MoE's forward in backward: the recomputation
leaves the module's state as one forward left it (aux-free load counts are not doubled)."""

from __future__ import annotations

import pytest
import torch
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
