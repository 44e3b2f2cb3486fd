"""``fo.sac_policy``: a selective-checkpointing policy written for aten's GEMMs saves the
library's GEMM ops too (they are ``fusible_ops::`` custom ops, which such a policy never
names), and the results equal an unchekpointed run."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fusible_ops as fo
from fusible_ops.kernels.sac import fusible_gemm_ops


def _block():
    torch.manual_seed(0)
    return fo.Sequential(
        fo.GroupedLinear(3, 8, 12, dtype=torch.float64),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(3, 6, 8, dtype=torch.float64),
    )


def _inputs():
    torch.manual_seed(1)
    splits = torch.tensor([2, 0, 5])
    return (
        torch.randn(7, 8, dtype=torch.float64, requires_grad=True),
        splits,
        torch.rand(7, dtype=torch.float64),
    )


def _aten_mm_policy(seen):
    def policy(ctx, func, *args, **kwargs):
        seen.append((func, ctx.is_recompute))
        if func is torch.ops.aten.mm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.mark.parametrize("adapt", [False, True])
def test_an_aten_gemm_policy_saves_the_fused_block_only_when_adapted(adapt):
    seq = _block()
    x, splits, probs = _inputs()
    want = seq(x, splits, probs, splits)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    seen = []
    policy = _aten_mm_policy(seen)
    if adapt:
        policy = fo.sac_policy(policy)
    context_fn = partial(create_selective_checkpoint_contexts, policy)
    out = checkpoint(seq, x, splits, probs, splits, use_reentrant=False, context_fn=context_fn)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    called = {func for func, _ in seen}
    gemm = torch.ops.fusible_ops.grouped_mlp_forward.default
    if adapt:  # the policy was asked about aten.mm in place of the library's GEMM op
        assert gemm not in called and torch.ops.aten.mm.default in called
    else:
        assert gemm in called  # and answered PREFER_RECOMPUTE: the aten policy never names it


def test_a_save_list_with_an_aten_gemm_saves_the_library_gemms():
    policy = fo.sac_policy([torch.ops.aten.mm.default])
    for op in fusible_gemm_ops():
        assert policy(None, op) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    only_mul = fo.sac_policy([torch.ops.aten.mul.Tensor])
    assert all(only_mul(None, op) == CheckpointPolicy.PREFER_RECOMPUTE for op in fusible_gemm_ops())


def test_a_save_list_policy_runs_under_checkpoint_and_matches():
    seq = _block()
    x, splits, probs = _inputs()
    want = seq(x, splits, probs, splits)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    context_fn = partial(create_selective_checkpoint_contexts, fo.sac_policy([torch.ops.aten.mm.default]))
    out = checkpoint(seq, x, splits, probs, splits, use_reentrant=False, context_fn=context_fn)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [3, ["mm"], [torch.mm]])
def test_bad_policies_are_refused(bad):
    with pytest.raises(TypeError, match="sac_policy"):
        fo.sac_policy(bad)
