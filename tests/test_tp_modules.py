"""TPLinear and LinearLoRA on one process (sharded runs are in test_tp_distributed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusible_ops.parallel import LinearLoRA, TPLinear, shard_colwise, shard_rowwise


def reference_lora(x, weight, bias, lora_a, lora_b, scale):
    """``x W^T + b + scale * (x A^T) B^T`` in float64."""
    x = x.double()
    out = x @ weight.double().t() + (x @ lora_a.double().t()) @ lora_b.double().t() * scale
    return out if bias is None else out + bias.double()


def make_lora(bias=True, **kwargs) -> LinearLoRA:
    torch.manual_seed(0)
    lora = LinearLoRA(8, 6, r=2, alpha=4, bias=bias, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        lora.lora_B.normal_()  # fresh adapters are a no-op; give B a value so they count
    return lora


class GraphCapture:
    def __init__(self) -> None:
        self.targets: list = []

    def __call__(self, gm, example_inputs):
        self.targets += [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- TPLinear
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8), (2, 2, 3, 8), (0, 8)])
def test_tplinear_matches_nn_linear(shape):
    torch.manual_seed(0)
    tp = TPLinear(8, 6, dtype=torch.float64)
    ref = nn.Linear(8, 6, dtype=torch.float64)
    ref.load_state_dict(tp.state_dict())
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(tp(x), ref(x), atol=1e-12, rtol=1e-12)
    assert isinstance(tp, nn.Linear) and set(tp.state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("module_cls, expected", [(TPLinear, torch.mm), (LinearLoRA, F.linear)])
def test_2d_compile_switch(fresh_dynamo, module_cls, expected):
    """TPLinear compiles 2-D input to torch.mm (mm_for_2d_compile=True); LinearLoRA keeps F.linear."""
    module = module_cls(8, 6)
    capture = GraphCapture()
    x = torch.randn(5, 8)
    torch.testing.assert_close(torch.compile(module, backend=capture)(x), module(x))
    assert expected in capture.targets
    assert (torch.mm in capture.targets) == (expected is torch.mm)


# ----------------------------------------------------------------------------- LinearLoRA
def test_lora_only_adapters_train_by_default():
    lora = LinearLoRA(8, 6)
    trainable = {name for name, p in lora.named_parameters() if p.requires_grad}
    assert trainable == {"lora_A", "lora_B"}
    assert lora.lora_A.shape == (8, 8) and lora.lora_B.shape == (6, 8) and lora.scale == 2.0
    x = torch.randn(3, 8)
    lora(x).sum().backward()
    assert lora.weight.grad is None and lora.bias.grad is None
    assert lora.lora_A.grad is not None and lora.lora_B.grad is not None
    unfrozen = LinearLoRA(8, 6, freeze_base=False)
    assert all(p.requires_grad for p in unfrozen.parameters())


def test_fresh_adapter_is_a_no_op():
    lora = LinearLoRA(8, 6)
    x = torch.randn(4, 8)
    torch.testing.assert_close(lora(x), F.linear(x, lora.weight, lora.bias))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8), (2, 2, 3, 8), (0, 3, 8)])
def test_lora_matches_reference(shape, bias):
    lora = make_lora(bias=bias)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    out = lora(x)
    ref_params = [
        p.detach().clone().requires_grad_() if p is not None else None
        for p in (lora.weight, lora.bias, lora.lora_A, lora.lora_B)
    ]
    x_ref = x.detach().clone().requires_grad_()
    ref = reference_lora(x_ref, *ref_params, lora.scale)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lora.lora_A.grad, ref_params[2].grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lora.lora_B.grad, ref_params[3].grad, atol=1e-12, rtol=1e-12)


def test_merged_and_unmerged_outputs_equal():
    lora = make_lora()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    weight_before = lora.weight.detach().clone()
    unmerged = lora(x)
    lora.merge()
    assert lora.merged
    assert not torch.equal(lora.weight, weight_before)
    torch.testing.assert_close(lora(x), unmerged, atol=1e-12, rtol=1e-12)
    with pytest.raises(RuntimeError, match="already merged"):
        lora.merge()
    lora.unmerge()
    torch.testing.assert_close(lora.weight, weight_before, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lora(x), unmerged, atol=1e-12, rtol=1e-12)
    with pytest.raises(RuntimeError, match="not merged"):
        lora.unmerge()


def test_dropout_applies_to_the_adapter_input_only():
    lora = make_lora(dropout=0.5)
    x = torch.randn(64, 8, dtype=torch.float64)
    base = F.linear(x, lora.weight, lora.bias)
    lora.train()
    torch.manual_seed(1)
    dropped = lora(x)
    torch.manual_seed(1)
    mask_input = F.dropout(x, 0.5, training=True)
    expected = base + (mask_input @ lora.lora_A.t()) @ lora.lora_B.t() * lora.scale
    torch.testing.assert_close(dropped, expected, atol=1e-12, rtol=1e-12)
    lora.eval()
    torch.testing.assert_close(
        lora(x), reference_lora(x, lora.weight, lora.bias, lora.lora_A, lora.lora_B, 2.0)
    )


def test_from_linear_wraps_an_existing_layer():
    torch.manual_seed(0)
    linear = nn.Linear(8, 6, dtype=torch.float64)
    lora = LinearLoRA.from_linear(linear, r=4, alpha=8)
    assert lora.weight is linear.weight and lora.bias is linear.bias
    assert not lora.weight.requires_grad and lora.r == 4 and lora.scale == 2.0
    assert lora.lora_A.device == linear.weight.device and lora.lora_A.dtype == torch.float64
    assert not lora.lora_A.is_meta and torch.count_nonzero(lora.lora_A) > 0
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(lora(x), linear(x))
    no_bias = LinearLoRA.from_linear(nn.Linear(8, 6, bias=False))
    assert no_bias.bias is None
    with pytest.raises(TypeError, match="expected an nn.Linear"):
        LinearLoRA.from_linear(nn.Conv1d(8, 6, 1))


@pytest.mark.parametrize(
    "kwargs, message", [({"r": 0}, "rank r must be positive"), ({"dropout": 1.0}, "dropout")]
)
def test_lora_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=f"LinearLoRA: {message}"):
        LinearLoRA(8, 6, **kwargs)


@pytest.mark.parametrize("helper", [shard_colwise, shard_rowwise])
def test_shard_helpers_reject_bad_modules(helper):
    with pytest.raises(TypeError, match=f"{helper.__name__}: expected TPLinear"):
        helper(nn.Conv1d(8, 6, 1), None)
    lora = make_lora()
    lora.merge()
    with pytest.raises(ValueError, match="unmerge"):
        helper(lora, None)
