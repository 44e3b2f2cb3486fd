"""GroupedLinear(weight_layout="in_out"): ``[G, in, out]`` weights, read in place by every backend.

Each case builds the same math twice, once per layout (the in_out weight is the out_in
weight transposed), and compares both with the float64 reference of tests/reference_ops:
forward, input gradient, and weight/bias gradients in the parameter's own layout.
"""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch
from error_model import BOTH_SIDES, expert_block_terms, tolerance
from torch.utils._python_dispatch import TorchDispatchMode

import fusible_ops as fo
from fusible_ops.checkpoint import export_stacked, load_stacked

CASES = [
    ("torch_loop", torch.float64),
    ("cpu", torch.float32),
    ("cpu", torch.bfloat16),
    ("grouped_mm", torch.float32),
]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}
SPLITS = [5, 0, 11, 8]


def _pair(num_groups, k, n, bias, dtype):
    """An out_in and an in_out GroupedLinear holding the same weights."""
    torch.manual_seed(0)
    out_in = fo.GroupedLinear(num_groups, k, n, bias=bias, dtype=dtype)
    in_out = fo.GroupedLinear(num_groups, k, n, bias=bias, weight_layout="in_out", dtype=dtype)
    with torch.no_grad():
        in_out.weight.copy_(out_in.weight.transpose(1, 2))
        if bias:
            in_out.bias.copy_(out_in.bias)
    return out_in, in_out


@pytest.mark.parametrize("backend, dtype", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_in_out_matches_reference(backend, dtype, bias):
    out_in, in_out = _pair(4, 16, 24, bias, dtype)
    assert in_out.weight.shape == (4, 16, 24) and "weight_layout='in_out'" in repr(in_out)
    x = torch.randn(sum(SPLITS), 16, dtype=torch.float64).to(dtype)
    grad = torch.randn(sum(SPLITS), 24, dtype=torch.float64).to(dtype)
    x64 = ref.leaf(x)
    w64 = ref.leaf(out_in.weight)
    b64 = ref.leaf(out_in.bias) if bias else None
    expected = ref.grouped_linear(x64, w64, b64, SPLITS)
    expected.backward(grad.double())
    for op in (out_in, in_out):
        xin = x.clone().requires_grad_()
        with fo.settings(backend=backend):
            y = fo.Sequential(op)(xin, SPLITS)
        y.backward(grad)
        assert ref.max_rel_err(y, expected) <= TOL[dtype]
        assert ref.max_rel_err(xin.grad, x64.grad) <= TOL[dtype]
        assert op.weight.grad.shape == op.weight.shape
        assert ref.max_rel_err(op.weight_out_in(op.weight.grad), w64.grad) <= TOL[dtype]
        if bias:
            assert ref.max_rel_err(op.bias.grad, b64.grad) <= TOL[dtype]
    # the basic op's weight gradient comes out in the parameter's layout, no transpose
    assert in_out.weight.grad.is_contiguous()


@pytest.mark.parametrize("backend, dtype", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("scale_after_fc2", [False, True])
def test_fused_expert_block_in_out_matches_out_in(backend, dtype, scale_after_fc2):
    """fc1 and fc2 in_out, the GPT-OSS layout (interleaved clamped SwiGLU, biases)."""
    fc1_a, fc1_b = _pair(4, 16, 32, True, dtype)
    fc2_a, fc2_b = _pair(4, 16, 16, True, dtype)
    act = (fo.ClampedSwiGLU if scale_after_fc2 else fo.ScaledClampedSwiGLU)(limit=1.5, glu_interleave_size=1)
    tail = [fo.Scale()] if scale_after_fc2 else []
    ref_seq = fo.Sequential(fc1_a, act, fc2_a, *tail)
    seq = fo.Sequential(fc1_b, act, fc2_b, *tail)
    x = torch.randn(sum(SPLITS), 16, dtype=torch.float64).to(dtype)
    probs = torch.rand(sum(SPLITS), dtype=torch.float64).to(dtype)
    grad = torch.randn(sum(SPLITS), 16, dtype=torch.float64).to(dtype)
    args = (SPLITS, SPLITS, probs) if scale_after_fc2 else (SPLITS, probs, SPLITS)
    results = []
    for s in (ref_seq, seq):
        xin = x.clone().requires_grad_()
        with fo.settings(backend=backend):
            y = s(xin, *args)
        y.backward(grad)
        assert s.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
        results.append((y, xin.grad))
    tol = TOL[dtype] * (4 if dtype == torch.bfloat16 else 10)
    assert ref.max_rel_err(results[1][0], results[0][0]) <= tol
    assert ref.max_rel_err(results[1][1], results[0][1]) <= tol
    for a, b in ((fc1_a, fc1_b), (fc2_a, fc2_b)):
        assert b.weight.grad.shape == b.weight.shape
        assert ref.max_rel_err(b.weight_out_in(b.weight.grad), a.weight.grad) <= tol
        assert ref.max_rel_err(b.bias.grad, a.bias.grad) <= tol


class _RecordCopies(TorchDispatchMode):
    """Records the sizes of every copy/clone/contiguous made while active."""

    def __init__(self):
        super().__init__()
        self.copied_numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (
            torch.ops.aten.clone.default,
            torch.ops.aten.copy_.default,
            torch.ops.aten._to_copy.default,
        ):
            self.copied_numels.append(args[0].numel())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["cpu", "grouped_mm"])
def test_in_out_weight_is_not_copied_per_call(backend):
    """The kernels read the in_out weight in place: no copy of its size in forward or backward."""
    _, in_out = _pair(8, 64, 96, False, torch.float32)
    seq = fo.Sequential(in_out)
    splits = [60] * 7 + [80]
    x = torch.randn(500, 64, requires_grad=True)
    grad = torch.randn(500, 96)
    with fo.settings(backend=backend):
        seq(x, splits)  # plan and caches first
        with _RecordCopies() as record:
            seq(x, splits).backward(grad)
    assert in_out.weight.numel() not in record.copied_numels, record.copied_numels


def test_checkpoint_helpers_and_per_group_keys_with_in_out():
    torch.manual_seed(1)
    a = fo.Sequential(
        fo.GroupedLinear(3, 8, 12, bias=True), fo.ScaledSwiGLU(), fo.GroupedLinear(3, 6, 8, bias=True)
    )
    b = fo.Sequential(
        fo.GroupedLinear(3, 8, 12, bias=True, weight_layout="in_out"),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(3, 6, 8, bias=True, weight_layout="in_out"),
    )
    state = export_stacked(a)
    load_stacked(
        b, state["gate_up"], state["down"], gate_up_bias=state["gate_up_bias"], down_bias=state["down_bias"]
    )
    torch.testing.assert_close(b[0].weight, a[0].weight.transpose(1, 2))
    for name, value in export_stacked(b).items():
        torch.testing.assert_close(value, state[name])
    x, probs, splits = torch.randn(7, 8), torch.rand(7), [3, 0, 4]
    torch.testing.assert_close(b(x, splits, probs, splits), a(x, splits, probs, splits))
    # per-group keys hold one group as stored: [in, out] for in_out
    c = fo.GroupedLinear(3, 8, 12, weight_layout="in_out")
    c.load_state_dict({f"weight{g}": b[0].weight[g] for g in range(3)}, strict=False)
    torch.testing.assert_close(c.weight, b[0].weight)


def test_in_out_compiles_fullgraph():
    _, in_out = _pair(4, 16, 24, True, torch.float32)
    seq = fo.Sequential(in_out)
    x = torch.randn(sum(SPLITS), 16)
    splits = torch.tensor(SPLITS)
    eager = seq(x, splits)
    torch._dynamo.reset()
    compiled = torch.compile(seq, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, splits), eager)


def test_bad_weight_layout_is_refused():
    with pytest.raises(
        ValueError, match=r"GroupedLinear: weight_layout must be one of \('out_in', 'in_out'\)"
    ):
        fo.GroupedLinear(2, 4, 4, weight_layout="oi")


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "dispatch_mode"])
def test_fused_block_in_out_weight_gradients_need_no_copy(traced):
    """The fused backward computes in_out weight gradients in the parameters' layout."""
    fc1 = fo.GroupedLinear(8, 64, 192, weight_layout="in_out")
    fc2 = fo.GroupedLinear(8, 96, 64, weight_layout="in_out")
    seq = fo.Sequential(fc1, fo.ScaledSwiGLU(), fc2)
    splits = [60] * 7 + [80]
    x, probs, grad = torch.randn(500, 64, requires_grad=True), torch.rand(500), torch.randn(500, 64)
    with fo.settings(backend="cpu"):
        seq(x, splits, probs, splits)
        record = _RecordCopies()
        with record if traced else _Null():
            seq(x, splits, probs, splits).backward(grad)
    assert fc1.weight.grad.is_contiguous() and fc2.weight.grad.is_contiguous()
    if traced:
        assert not {fc1.weight.numel(), fc2.weight.numel()} & set(record.copied_numels), record.copied_numels


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fused_gpt_oss_layout_block_compiles_with_inductor():
    """The in_out weight gradients' strides (fake and real alike) survive Inductor."""
    torch.manual_seed(2)
    fc1 = fo.GroupedLinear(4, 16, 32, bias=True, weight_layout="in_out")
    fc2 = fo.GroupedLinear(4, 16, 16, bias=True, weight_layout="in_out")
    seq = fo.Sequential(fc1, fo.ClampedSwiGLU(glu_interleave_size=1), fc2, fo.Scale())
    x, probs, splits = torch.randn(20, 16, requires_grad=True), torch.rand(20), torch.tensor([5, 0, 7, 8])
    seq(x, splits, splits, probs).square().sum().backward()
    expected = [p.grad.clone() for p in seq.parameters()] + [x.grad.clone()]
    seq.zero_grad()
    x.grad = None
    torch._dynamo.reset()
    torch.compile(seq, fullgraph=True)(x, splits, splits, probs).square().sum().backward()
    for got, want in zip([p.grad for p in seq.parameters()] + [x.grad], expected):
        # compiled vs eager in float32, both rounding (<= 8 rows a group, condition <= 4)
        torch.testing.assert_close(
            got, want, **tolerance(torch.float32, expert_block_terms(16, 16, 8), 4 * BOTH_SIDES)
        )
        assert got.is_contiguous()
