"""Deep copies and ``functional_call`` under ``torch.compile``.

A ``copy.deepcopy``'d layer takes the one-node compiled path on its first compiled call
(no eager call needed) and compiles with ``fullgraph=True`` with every MoE option; a
compiled ``functional_call`` checks and computes with the tensors passed in.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_moe_options import MODELS, make_moe, tokens

import fusible_ops as fo
from fusible_ops.fuser.compiled import fuser_in_graph

OPTIONS = {
    **MODELS,
    "aux_loss": dict(num_experts=4, top_k=2, load_balancing="aux_loss", z_loss_coeff=0.1),
    "seq_aux_loss": dict(num_experts=4, top_k=2, load_balancing="seq_aux_loss"),
    "aux_free": dict(num_experts=4, top_k=2, load_balancing="aux_free"),
    "jitter": dict(num_experts=4, top_k=2, router_jitter=0.0),
}


class _Graphs:
    """An aot_eager backend that keeps the Dynamo graphs it is given."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def fast_path_calls(self) -> int:
        return sum(node.target is fuser_in_graph for gm in self.graphs for node in gm.graph.nodes)


def _forward_backward(module, x):
    x = x.clone().requires_grad_()
    out = module(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_deep_copy_takes_the_fast_path_and_compiles_fullgraph(name):
    torch._dynamo.reset()
    original = make_moe(OPTIONS[name])
    copied = copy.deepcopy(original)
    backend = _Graphs()
    compiled = torch.compile(copied, backend=backend, fullgraph=True)
    got = _forward_backward(compiled, tokens())
    assert backend.fast_path_calls() == 1  # the routed experts (BasicLinear is traced through)
    want = _forward_backward(original, tokens())
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b)


def test_pickled_sequential_takes_the_fast_path():
    import pickle

    seq = fo.Sequential(fo.GroupedLinear(2, 4, 6))
    restored = pickle.loads(pickle.dumps(seq))
    backend = _Graphs()
    torch.compile(restored, backend=backend, fullgraph=True)(torch.randn(3, 4), torch.tensor([1, 2]))
    assert backend.fast_path_calls() == 1


def _bf16(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).requires_grad_() for k, v in module.named_parameters()}


@pytest.mark.parametrize("target", ["moe", "experts"])
def test_compiled_functional_call_checks_the_tensors_passed(target):
    """bf16 weights into an fp32 module: the compiled call computes (and checks) with them,
    as the eager call does; the module's own fp32 parameters are untouched."""
    torch.manual_seed(0)
    moe = fo.MoE(8, 6, 4, 2)
    module = moe if target == "moe" else moe.experts
    if target == "moe":
        args = (torch.randn(2, 5, 8, dtype=torch.bfloat16),)
    else:
        splits = torch.tensor([3, 0, 4, 0])
        args = (torch.randn(7, 8, dtype=torch.bfloat16), splits, torch.rand(7).bfloat16(), splits)
    params = _bf16(module)
    eager_params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    want = torch.func.functional_call(module, eager_params, args)
    want.float().sum().backward()
    compiled = torch.compile(
        lambda p, *a: torch.func.functional_call(module, p, a), backend="aot_eager", fullgraph=True
    )
    got = compiled(params, *args)
    got.float().sum().backward()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    for name in params:
        torch.testing.assert_close(params[name].grad, eager_params[name].grad, msg=name)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    # and a mismatch the eager call refuses is refused compiled too
    wrong = {k: v.detach().double() for k, v in params.items()}
    with pytest.raises(Exception, match="dtype"):
        compiled(wrong, *args)
