"""Low-precision recipes with checkpoints: torch.distributed.checkpoint (DCP) round trips
and activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``).

Every comparison runs the same kernels on the same values, so it is exact
(``torch.equal``): the reference is the same module under the same recipe, without the
checkpoint (activation checkpointing) or before the save (DCP).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.checkpoint import checkpoint

import fusible_ops as fo

R = fo.recipes
RECIPES = [R.MXFP8(), R.Float8Tensorwise(), R.Float8Rowwise(), R.Float8Blockwise()]
SPLITS = [3, 0, 5, 4]
ROWS = sum(SPLITS)


def _ids(recipe) -> str:
    return type(recipe).__name__ + ("-wgrad_hp" if recipe.wgrad_high_precision else "")


# ---------------------------------------------------------------- DCP
def _moe(recipe=None) -> fo.MoE:
    torch.manual_seed(0)
    return fo.MoE(32, 16, 4, 2, bias=True, recipe=recipe)


def _step(moe, x, opt) -> None:
    moe(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _load(moe, path) -> None:
    """DCP's documented in-place load: into the module's state dict, then load_state_dict."""
    state = moe.state_dict()
    dcp.load(state, checkpoint_id=path)
    moe.load_state_dict(state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("recipe", RECIPES, ids=_ids)
def test_dcp_round_trip_of_a_module_used_under_a_recipe(tmp_path, recipe):
    """The checkpoint holds the float32 parameters under the unquantized module's keys and
    nothing else; loading it back (into the module that moved on, or a fresh one) gives
    the saved weights bit for bit and the saved module's quantized output, exactly."""
    path = str(tmp_path / "ckpt")
    plain = _moe().state_dict()
    moe = _moe(recipe)
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))
    _step(moe, x, opt)
    with torch.no_grad():
        before = moe(x)  # quantized copies of the weights being saved are cached now
    assert f"recipe {type(recipe).__name__}" in str(moe.experts.last_plan)
    state = moe.state_dict()
    assert list(state) == list(plain)
    assert all(state[k].dtype == plain[k].dtype == torch.float32 for k in plain)
    saved = {k: v.clone() for k, v in state.items()}
    dcp.save(state, checkpoint_id=path)

    metadata = dcp.FileSystemReader(path).read_metadata()
    entries = metadata.state_dict_metadata
    assert sorted(entries) == sorted(plain)
    for key, entry in entries.items():
        assert entry.properties.dtype == torch.float32, (key, entry.properties.dtype)
        assert tuple(entry.size) == tuple(plain[key].shape), (key, entry.size)
    # the files hold as many bytes as a checkpoint of a module never run under a recipe
    dcp.save(plain, checkpoint_id=str(tmp_path / "plain"))
    plain_metadata = dcp.FileSystemReader(str(tmp_path / "plain")).read_metadata()
    stored = {i.fqn: info.length for i, info in metadata.storage_data.items()}
    assert stored == {i.fqn: info.length for i, info in plain_metadata.storage_data.items()}

    _step(moe, x, opt)  # the weights move on; the cache now holds copies of the new ones
    with torch.no_grad():
        assert not torch.equal(moe(x), before)
    _load(moe, path)
    assert all(torch.equal(moe.state_dict()[k], saved[k]) for k in saved)
    with torch.no_grad():
        assert torch.equal(moe(x), before)  # no quantized copy of the moved-on weights is used

    fresh = _moe(recipe)
    _load(fresh, path)
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
    with torch.no_grad():
        assert torch.equal(fresh(x), before)


# ---------------------------------------------------------------- activation checkpointing
def _block() -> fo.Sequential:
    torch.manual_seed(0)
    return fo.Sequential(
        fo.GroupedLinear(4, 32, 48, bias=True),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(4, 24, 32, bias=True),
    )


def _inputs():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(ROWS, 32, generator=gen).requires_grad_()
    probs = torch.rand(ROWS, generator=gen).requires_grad_()
    return x, probs, torch.tensor(SPLITS)


def _grads(seq, out, x, probs) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.square().sum(), [x, probs, *seq.parameters()])


def _run(seq, recipe, *, ckpt: bool, backward_inside: bool = True, fusion: bool = True):
    x, probs, splits = _inputs()
    with fo.quantized(recipe), fo.settings(fusion=fusion):
        if ckpt:
            out = checkpoint(seq, x, splits, probs, splits, use_reentrant=False)
        else:
            out = seq(x, splits, probs, splits)
        if backward_inside:
            return out.detach(), _grads(seq, out, x, probs)
    return out.detach(), _grads(seq, out, x, probs)


def _assert_same(got, want) -> None:
    (out, grads), (want_out, want_grads) = got, want
    assert torch.equal(out, want_out)
    for index, (g, w) in enumerate(zip(grads, want_grads)):
        assert torch.equal(g, w), f"gradient {index}: max abs diff {float((g - w).abs().max())}"


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("recipe", [*RECIPES, R.Float8Rowwise(wgrad_high_precision=True)], ids=_ids)
def test_activation_checkpointing_with_backward_inside_the_context(recipe, fusion):
    """The recomputation runs under the recipe too: gradients equal the quantized run's."""
    seq = _block()
    want = _run(seq, recipe, ckpt=False, fusion=fusion)
    got = _run(seq, recipe, ckpt=True, fusion=fusion)
    _assert_same(got, want)
    assert f"recipe {type(recipe).__name__}" in str(seq.last_plan)
    forward = seq.last_plan.fusion_plans[0].forward_op_types()
    assert (forward == ["GroupedMLP"]) == fusion, forward
    plain = _run(seq, None, ckpt=False, fusion=fusion)
    assert not torch.equal(got[1][0], plain[1][0])  # the recipe is not a no-op here


@pytest.mark.parametrize("recipe", [R.MXFP8(), R.Float8Rowwise(wgrad_high_precision=True)], ids=_ids)
def test_activation_checkpointing_of_a_module_recipe_with_backward_anywhere(recipe):
    """A module's own recipe needs no context: the recomputation in a backward outside any
    ``fo.quantized`` block is quantized as the forward was."""
    moe = fo.MoE(32, 16, 4, 2, recipe=recipe)
    x0 = torch.randn(10, 32, generator=torch.Generator().manual_seed(3))

    def grads(ckpt: bool):
        x = x0.clone().requires_grad_()
        out = checkpoint(moe, x, use_reentrant=False) if ckpt else moe(x)
        return out.detach(), torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])

    _assert_same(grads(True), grads(False))


@pytest.mark.parametrize("recipe", [*RECIPES, R.Float8Rowwise(wgrad_high_precision=True)], ids=_ids)
@pytest.mark.parametrize("fusion", [True, False])
def test_backward_outside_the_context_recomputes_under_the_forwards_recipe(recipe, fusion):
    """The recomputation runs in backward, outside the ``fo.quantized`` block: it runs under
    the recipe its forward ran with, so the gradients are the quantized ones exactly."""
    seq = _block()
    with fo.settings(fusion=fusion):  # in force for the backward too
        want = _run(seq, recipe, ckpt=False, fusion=fusion)
        got = _run(seq, recipe, ckpt=True, backward_inside=False, fusion=fusion)
    _assert_same(got, want)


def test_a_recomputation_that_cannot_tell_its_recipe_is_refused():
    """Two live forwards of one module under different recipes, then a recomputation
    outside both blocks: which recipe it should run under is ambiguous, so it raises."""
    seq = _block()
    x, probs, splits = _inputs()
    with fo.quantized(R.MXFP8()):
        first = checkpoint(seq, x, splits, probs, splits, use_reentrant=False)
    with fo.quantized(R.Float8Rowwise()):
        second = seq(x, splits, probs, splits)  # still alive: its graph is not freed
    with pytest.raises(RuntimeError, match="cannot tell which low-precision recipe"):
        first.sum().backward()
    del second


@pytest.mark.parametrize("recipe", [R.MXFP8(), R.Float8Rowwise(wgrad_high_precision=True)], ids=_ids)
def test_checkpointed_moe_under_the_context_with_backward_outside(recipe):
    moe = fo.MoE(32, 16, 4, 2)
    x0 = torch.randn(10, 32, generator=torch.Generator().manual_seed(3))

    def grads(ckpt: bool):
        x = x0.clone().requires_grad_()
        with fo.quantized(recipe):
            out = checkpoint(moe, x, use_reentrant=False) if ckpt else moe(x)
        return out.detach(), torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])

    _assert_same(grads(True), grads(False))
