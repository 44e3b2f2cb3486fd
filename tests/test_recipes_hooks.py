"""A module's recipe holds when its ops have module hooks (FSDP2's, or a user's): the
hooked op runs alone through ``nn.Module.__call__`` and still runs quantized."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo


@pytest.mark.parametrize("recipe", [fo.recipes.MXFP8(), fo.recipes.Float8Rowwise()], ids=repr)
@pytest.mark.parametrize("hooked", [0, 2])
def test_module_recipe_survives_a_forward_hook(recipe, hooked):
    torch.manual_seed(0)
    seq = fo.Sequential(
        fo.GroupedLinear(2, 64, 64), fo.ScaledSwiGLU(), fo.GroupedLinear(2, 32, 64), recipe=recipe
    )
    x, splits, probs = torch.randn(8, 64, requires_grad=True), torch.tensor([3, 5]), torch.rand(8)
    want = seq(x, splits, probs, splits)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    calls = []
    seq[hooked].register_forward_hook(lambda module, args, out: calls.append(module))
    got = seq(x, splits, probs, splits)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    assert calls == [seq[hooked]]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)
    seq.recipe = None  # and the quantized result is not the plain one
    assert not torch.equal(seq(x, splits, probs, splits), want)


def test_a_hook_replacing_the_output_after_a_recipe_context_was_used():
    with fo.quantized(fo.recipes.MXFP8()):
        pass  # a recipe context seen once: fusers track the recipe of their forwards
    seq = fo.Sequential(fo.GroupedLinear(2, 4, 4))
    seq[0].register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(3, 4, requires_grad=True)
    out = seq(x, torch.tensor([1, 2]))
    weight = seq[0].weight
    want = torch.cat([x[:1] @ weight[0].T, x[1:] @ weight[1].T])
    torch.testing.assert_close(out, 2 * want)
    out.sum().backward()  # and its graph frees normally
