"""Fused GroupedMLP == unfused ops == an independent per-expert reference."""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch
from error_model import EXPERT_BLOCK_ROUNDINGS, rounding_rtol
from hypothesis import given, settings
from hypothesis import strategies as st

import fusible_ops as fo

# ---------------------------------------------------------------- independent reference


def reference(x, split_sizes, probs, w1, b1, w2, b2, kind, *, scale_after=False, interleave=None):
    outs, start = [], 0
    for e, n in enumerate(split_sizes):
        rows = slice(start, start + n)
        h = x[rows] @ w1[e].T + (b1[e] if b1 is not None else 0)
        a = ref.activation(kind, h, interleave)
        if not scale_after:
            a = a * probs[rows, None]
        y = a @ w2[e].T + (b2[e] if b2 is not None else 0)
        if scale_after:
            y = y * probs[rows, None]
        outs.append(y)
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


SCALED = {
    "swiglu": fo.ScaledSwiGLU,
    "geglu": fo.ScaledGEGLU,
    "clamped_swiglu": fo.ScaledClampedSwiGLU,
    "srelu": fo.ScaledSReLU,
}
UNSCALED = {"swiglu": fo.SwiGLU, "geglu": fo.GEGLU, "clamped_swiglu": fo.ClampedSwiGLU, "srelu": fo.SReLU}


def build(kind, experts, hidden, ffn, *, bias=False, scale_after=False, dtype=torch.float64, interleave=None):
    gated = kind != "srelu"
    fc1_out = 2 * ffn if gated else ffn
    kwargs = {"glu_interleave_size": interleave} if interleave else {}
    act = (UNSCALED if scale_after else SCALED)[kind](**kwargs)
    ops = [
        fo.GroupedLinear(experts, hidden, fc1_out, bias=bias, dtype=dtype),
        act,
        fo.GroupedLinear(experts, ffn, hidden, bias=bias, dtype=dtype),
    ]
    if scale_after:
        ops.append(fo.Scale())
    seq = fo.Sequential(*ops)
    with torch.no_grad():
        for p in seq.parameters():
            p.normal_(0, 0.3)
    return seq


def run(seq, x, split_sizes, probs, *, scale_after=False, op_kwargs=None, fusion=True):
    x = x.detach().requires_grad_()
    probs = probs.detach().requires_grad_()
    for p in seq.parameters():
        p.grad = None
    splits = torch.tensor(split_sizes, dtype=torch.int64)
    args = (x, splits, probs, splits) if not scale_after else (x, splits, splits, probs)
    with fo.settings(fusion=fusion):
        y = seq(*args, op_kwargs=op_kwargs)
    grad = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    y.backward(grad)
    grads = [x.grad, probs.grad] + [p.grad for p in seq.parameters()]
    return y.detach(), grads, grad, seq.last_plan.groups[0]


def ref_run(seq, x, split_sizes, probs, grad, kind, *, scale_after=False, interleave=None):
    params = [p.detach().double().requires_grad_() for p in seq.parameters()]
    fc1, fc2 = seq[0], seq[2]
    it = iter(params)
    w1 = next(it)
    b1 = next(it) if fc1.bias is not None else None
    w2 = next(it)
    b2 = next(it) if fc2.bias is not None else None
    xr = x.detach().double().requires_grad_()
    pr = probs.detach().double().requires_grad_()
    y = reference(xr, split_sizes, pr, w1, b1, w2, b2, kind, scale_after=scale_after, interleave=interleave)
    y.backward(grad.double())
    return y.detach(), [xr.grad, pr.grad] + [p.grad for p in params]


def assert_close_all(got, want, atol, rtol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", list(SCALED))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scale_after", [False, True])
def test_fused_equals_unfused_equals_reference_float64(kind, bias, scale_after):
    torch.manual_seed(0)
    split_sizes = [3, 0, 6, 1]
    seq = build(kind, 4, 8, 6, bias=bias, scale_after=scale_after)
    x = torch.randn(10, 8, dtype=torch.float64)
    probs = torch.rand(10, dtype=torch.float64)
    y_f, g_f, grad, plan = run(seq, x, split_sizes, probs, scale_after=scale_after)
    assert plan.forward_op_types() == ["GroupedMLP"] and plan.backward_op_types() == ["GroupedMLP"]
    y_u, g_u, _, plan_u = run(seq, x, split_sizes, probs, scale_after=scale_after, fusion=False)
    assert "GroupedMLP" not in plan_u.forward_op_types()
    y_r, g_r = ref_run(seq, x, split_sizes, probs, grad, kind, scale_after=scale_after)
    torch.testing.assert_close(y_f, y_r, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(y_u, y_r, atol=1e-10, rtol=1e-10)
    assert_close_all(g_f, g_r, 1e-10, 1e-10)
    assert_close_all(g_u, g_r, 1e-10, 1e-10)


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["swiglu", "clamped_swiglu"])
def test_bf16_within_tolerance_and_fp32_scales(kind):
    torch.manual_seed(1)
    split_sizes = [40, 0, 25, 31]
    seq = build(kind, 4, 32, 24, dtype=torch.bfloat16)
    x = torch.randn(96, 32, dtype=torch.bfloat16)
    probs = torch.rand(96, dtype=torch.float32)
    y, grads, grad, plan = run(seq, x, split_sizes, probs)
    assert plan.forward_op_types() == ["GroupedMLP"]
    assert grads[1].dtype == torch.float32  # grad of the fp32 scales keeps their dtype
    y_r, g_r = ref_run(seq, x, split_sizes, probs, grad, kind)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    # bf16 vs float64 on the same bf16 values, norm-wise: the output rounds three times
    # (fc1, activation, fc2; condition 2 through the GLU), a gradient at most at every
    # stored result of the block
    assert rel(y, y_r) < rounding_rtol(torch.bfloat16, 3, condition=2)
    for g, r in zip(grads, g_r):
        assert rel(g, r) < rounding_rtol(torch.bfloat16, EXPERT_BLOCK_ROUNDINGS)


@pytest.mark.parametrize("interleave", [1, 2])
def test_glu_interleave(interleave):
    torch.manual_seed(2)
    split_sizes = [2, 5, 0]
    seq = build("swiglu", 3, 8, 4, interleave=interleave)
    x = torch.randn(7, 8, dtype=torch.float64)
    probs = torch.rand(7, dtype=torch.float64)
    y, grads, grad, plan = run(seq, x, split_sizes, probs)
    assert plan.forward_op_types() == ["GroupedMLP"]
    y_r, g_r = ref_run(seq, x, split_sizes, probs, grad, "swiglu", interleave=interleave)
    torch.testing.assert_close(y, y_r)
    assert_close_all(grads, g_r, 1e-10, 1e-10)


@pytest.mark.parametrize("split_sizes", [[0, 0, 0], [9, 0, 0], [0, 0, 9], [4, 0, 5]])
def test_edge_splits(split_sizes):
    torch.manual_seed(3)
    rows = sum(split_sizes)
    seq = build("swiglu", 3, 8, 4)
    x = torch.randn(rows, 8, dtype=torch.float64)
    probs = torch.rand(rows, dtype=torch.float64)
    y, grads, grad, _ = run(seq, x, split_sizes, probs)
    assert y.shape == (rows, 8)
    for p_grad in grads[2:]:
        assert p_grad is not None  # zeros, not None, even with no rows
    if rows == 0:
        assert all(float(g.abs().sum()) == 0 for g in grads[2:])
        return
    y_r, g_r = ref_run(seq, x, split_sizes, probs, grad, "swiglu")
    torch.testing.assert_close(y, y_r)
    assert_close_all(grads, g_r, 1e-10, 1e-10)


@settings(max_examples=12, deadline=None)
@given(
    split_sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    kind=st.sampled_from(list(SCALED)),
)
def test_random_splits_property(split_sizes, kind):
    torch.manual_seed(len(split_sizes))
    rows = sum(split_sizes)
    seq = build(kind, len(split_sizes), 6, 4, bias=True)
    x = torch.randn(rows, 6, dtype=torch.float64)
    probs = torch.rand(rows, dtype=torch.float64)
    y, grads, grad, _ = run(seq, x, split_sizes, probs)
    y_r, g_r = ref_run(seq, x, split_sizes, probs, grad, kind)
    torch.testing.assert_close(y, y_r)
    assert_close_all(grads, g_r, 1e-9, 1e-9)


def test_buffers_in_place_and_bit_identical():
    torch.manual_seed(4)
    split_sizes = [5, 0, 7, 4]
    seq = build("swiglu", 4, 16, 12, dtype=torch.bfloat16)
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    probs = torch.rand(16)
    y0, g0, _, _ = run(seq, x, split_sizes, probs)
    out_buf = torch.full((20, 16), 3.0, dtype=torch.bfloat16)
    grad_buf = torch.empty(16, 16, dtype=torch.bfloat16)
    kwargs = {2: {fo.OUTPUT_BUFFER_KEY: out_buf}, seq[0]: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}
    x_leaf = x.clone().requires_grad_()
    splits = torch.tensor(split_sizes)
    y = seq(x_leaf, splits, probs, splits, op_kwargs=kwargs)
    assert seq.last_plan.groups[0].forward_op_types() == ["GroupedMLP"]
    assert y.data_ptr() == out_buf.data_ptr()
    assert torch.equal(y, y0)
    assert bool((out_buf[16:] == 3.0).all())
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
    assert torch.equal(grad_buf, x_leaf.grad)
    assert torch.equal(x_leaf.grad, g0[0])


def test_saved_bytes_input_fc1_output_scales_only():
    seq = build("swiglu", 4, 32, 48, dtype=torch.float32)
    rows = 64
    x = torch.randn(rows, 32, requires_grad=True)
    probs = torch.rand(rows, requires_grad=True)
    splits = torch.tensor([20, 0, 30, 14])
    params = {p.untyped_storage().data_ptr() for p in seq.parameters()}

    def saved_bytes(fusion: bool) -> int:
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fo.settings(fusion=fusion):
            seq(x, splits, probs, splits)
        return sum(seen.values())

    fused, unfused = saved_bytes(True), saved_bytes(False)
    budget = x.numel() * 4 + rows * 96 * 4 + probs.numel() * 4 + 4 * 4 * 2  # + int32 offsets
    assert fused <= budget
    assert fused < unfused


def test_decline_reasons_and_fallback():
    seq = build("swiglu", 4, 8, 6)
    x = torch.randn(10, 8, dtype=torch.float64)
    probs = torch.rand(10, dtype=torch.float64)
    a, b = torch.tensor([3, 0, 6, 1]), torch.tensor([3, 0, 6, 1])
    plan = seq.explain(x, a, probs, b).groups[0]
    assert plan.forward_op_types() == ["GroupedMLP"]  # equal values on CPU: compared cheaply
    plan = seq.explain(x, [3, 0, 6, 1], probs, [4, 0, 5, 1]).groups[0]
    assert plan.forward_op_types() == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    assert "different split sizes" in str(plan)
    buf = torch.empty(10, 12, dtype=torch.float64)
    plan = seq.explain(x, a, probs, a, op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: buf}}).groups[0]
    assert "output buffer requested on fc1" in str(plan)
    # the unfused fallback honours the fc1 buffer
    y = seq(x, a, probs, a, op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: buf}})
    assert y.shape == (10, 8)
    mismatched = fo.Sequential(fo.GroupedLinear(4, 8, 10), fo.ScaledSwiGLU(), fo.GroupedLinear(4, 6, 8))
    with pytest.raises(ValueError):
        mismatched(torch.randn(10, 8), a, torch.rand(10), a)  # the unfused ops reject it too
    other_groups = fo.Sequential(fo.GroupedLinear(4, 8, 12), fo.ScaledSwiGLU(), fo.GroupedLinear(2, 6, 8))
    plan = other_groups.explain(torch.randn(10, 8), a, torch.rand(10), [5, 5]).groups[0]
    assert "fc1.num_groups (4) != fc2.num_groups (2)" in str(plan)


def test_forced_backend_that_cannot_run_raises():
    seq = build("swiglu", 2, 8, 4)
    x = torch.randn(4, 8, dtype=torch.float64)
    with fo.settings(backend="grouped_mm"), pytest.raises(fo.BackendUnavailableError, match="float64"):
        seq(x, [2, 2], torch.rand(4, dtype=torch.float64), [2, 2])
    with pytest.raises(ValueError, match="unknown backend"):
        with fo.settings(backend="nope"):
            pass


@pytest.mark.parametrize("backend", ["cpu", "torch_loop", "grouped_mm"])
def test_each_cpu_backend_forced(backend):
    torch.manual_seed(5)
    split_sizes = [6, 0, 10]
    seq = build("swiglu", 3, 16, 8, dtype=torch.float32)
    x = torch.randn(16, 16)
    probs = torch.rand(16)
    with fo.settings(backend=backend):
        y, grads, grad, plan = run(seq, x, split_sizes, probs)
    assert plan.forward[0].backend_name == backend
    y_r, g_r = ref_run(seq, x, split_sizes, probs, grad, "swiglu")
    assert_close_all([y, *grads], [y_r, *g_r], 1e-4, 1e-4)


def test_backend_size_rules_are_checked_at_plan_time():
    seq = fo.Sequential(fo.GroupedLinear(2, 6, 10), fo.ScaledSwiGLU(), fo.GroupedLinear(2, 5, 6))
    x, probs = torch.randn(5, 6), torch.rand(5)
    with fo.settings(backend="grouped_mm"), pytest.raises(fo.BackendUnavailableError, match="multiple of"):
        seq(x, [2, 3], probs, [2, 3])
    y = seq(x, [2, 3], probs, [2, 3])  # automatic selection picks a backend that takes these sizes
    assert y.shape == (5, 6)
    assert "backend cpu" in str(seq.last_plan)


# ---------------------------------------------------------------- regressions found in review


def test_scale_after_fc2_with_fc2_buffer_declines_and_matches_unfused():
    seq = fo.Sequential(fo.GroupedLinear(2, 8, 12), fo.SwiGLU(), fo.GroupedLinear(2, 6, 8), fo.Scale())
    x, probs = torch.randn(5, 8), torch.rand(5)
    bufs = [torch.zeros(5, 8), torch.zeros(5, 8)]
    outs = []
    for fusion, buf in zip((True, False), bufs):
        with fo.settings(fusion=fusion):
            outs.append(seq(x, [2, 3], [2, 3], probs, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: buf}}))
    assert "output buffer requested on fc2 with Scale after it" in str(
        seq.explain(x, [2, 3], [2, 3], probs, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: bufs[0]}})
    )
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(bufs[0], bufs[1])


def test_scale_after_fc2_saves_no_more_than_input_fc1_output_scales():
    seq = fo.Sequential(
        fo.GroupedLinear(4, 64, 192, bias=True),
        fo.SwiGLU(),
        fo.GroupedLinear(4, 96, 64, bias=True),
        fo.Scale(),
    )
    x = torch.randn(512, 64, requires_grad=True)
    probs = torch.rand(512, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in seq.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    splits = torch.tensor([100, 0, 300, 112])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = seq(x, splits, splits, probs)
    assert seq.last_plan.groups[0].forward_op_types() == ["GroupedMLP"]
    assert sum(seen.values()) <= (512 * 64 + 512 * 192 + 512) * 4 + 4 * 4
    y.sum().backward()


@pytest.mark.parametrize("fusion", [True, False])
def test_grouped_mm_backend_zero_rows(fusion):
    seq = fo.Sequential(fo.GroupedLinear(3, 16, 32), fo.ScaledSwiGLU(), fo.GroupedLinear(3, 16, 16))
    x = torch.randn(0, 16, requires_grad=True)
    with fo.settings(backend="grouped_mm", fusion=fusion):
        y = seq(x, [0, 0, 0], torch.rand(0), [0, 0, 0])
        y.sum().backward()
    assert float(seq[0].weight.grad.abs().sum()) == 0.0


def test_inf_in_one_expert_stays_in_that_expert():
    lin = fo.GroupedLinear(4, 8, 8)
    with torch.no_grad():
        lin.weight[3].fill_(float("inf"))  # expert 3 receives no rows
    x = torch.randn(6, 8, requires_grad=True)
    y = lin(x, [2, 2, 2, 0])
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.isfinite(lin.weight.grad[:3]).all()
