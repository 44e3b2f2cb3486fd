"""The MoE layer's routing statistics follow every forward, whatever wrote the flags buffer
before it (an eager forward skips writing flag values the buffer already holds)."""

from __future__ import annotations

import copy

import torch

import fusible_ops as fo


def make_moe(**options) -> fo.MoE:
    torch.manual_seed(0)
    return fo.MoE(16, 8, 4, 2, dtype=torch.float64, **options)


def test_dropped_load_and_losses_come_and_go_with_the_options():
    moe = make_moe()
    x = torch.randn(12, 16, dtype=torch.float64)
    moe(x)
    assert moe.last_dropped_load is None and moe.aux_losses == {}
    moe.capacity_factor = 1.0
    moe.z_loss_coeff = 1e-3
    moe(x)
    assert moe.last_dropped_load is not None
    assert set(moe.aux_losses) == {"z_loss"} and moe.aux_losses["z_loss"].dtype == torch.float64
    moe.capacity_factor = None
    moe.z_loss_coeff = 0.0
    moe(x)
    assert moe.last_dropped_load is None and moe.aux_losses == {}
    assert int(moe.last_expert_load.sum()) == 12 * 2


def test_flags_written_by_someone_else_are_written_again():
    moe = make_moe()
    x = torch.randn(12, 16, dtype=torch.float64)
    moe(x)
    moe(x)  # the flags hold this forward's values already: nothing written
    with torch.no_grad():
        moe._stat_flags.zero_()
    assert moe.last_expert_load is None
    moe(x)
    assert moe.last_expert_load is not None


def test_a_copy_records_into_its_own_buffers():
    moe = make_moe()
    x = torch.randn(12, 16, dtype=torch.float64)
    moe(x)
    twin = copy.deepcopy(moe)
    with torch.no_grad():
        twin._stat_flags.zero_()
        twin._load_stat.zero_()
    twin(x)
    assert torch.equal(twin.last_expert_load, moe.last_expert_load)
    moved = moe.to(torch.float32)  # new buffers: written afresh
    moved(x.float())
    assert int(moved.last_expert_load.sum()) == 12 * 2
