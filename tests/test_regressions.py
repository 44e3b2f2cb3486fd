"""Regressions found in review: each test failed before its fix."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fusible_ops as fo


@pytest.mark.parametrize(
    "make",
    [
        lambda: fo.Sequential(fo.ReLU(), fo.BasicLinear(8, 4)),
        lambda: fo.Sequential(fo.LayerNorm(8), fo.BasicLinear(8, 4)),
        lambda: fo.Sequential(fo.Dropout(0.5), fo.BasicLinear(8, 4)),
    ],
)
def test_backward_when_the_first_ops_need_no_grad(make):
    seq = make()
    x = torch.randn(5, 8)  # plain data: no grad needed before the linear
    for p in seq[0].parameters():
        p.requires_grad_(False)
    seq(x).sum().backward()
    assert seq[1].weight.grad is not None


def test_frozen_first_grouped_linear():
    seq = fo.Sequential(fo.GroupedLinear(2, 8, 6), fo.ReLU(), fo.GroupedLinear(2, 6, 4))
    seq[0].weight.requires_grad_(False)
    seq(torch.randn(5, 8), [2, 3], [2, 3]).sum().backward()
    assert seq[0].weight.grad is None and seq[2].weight.grad is not None


@pytest.mark.parametrize("fusion", [True, False])
def test_outputs_can_be_modified_in_place(fusion):
    seq = fo.Sequential(fo.GroupedLinear(2, 8, 12), fo.ScaledSwiGLU(), fo.GroupedLinear(2, 6, 8))
    x = torch.randn(5, 8, requires_grad=True)
    buf = torch.zeros(6, 8)
    with fo.settings(fusion=fusion):
        out = seq(x, [2, 3], torch.rand(5), [2, 3], op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: buf}})
    out.add_(1.0)  # e.g. a residual added in place, as with torch.nn.Linear
    assert out.data_ptr() == buf.data_ptr()
    out.sum().backward()
    assert x.grad is not None


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
def test_autocast_dense_linear(fusion):
    lin = fo.Sequential(fo.BasicLinear(8, 6), fo.Bias(6), fo.GELU())
    ref = torch.nn.Linear(8, 6)
    with torch.no_grad():
        ref.weight.copy_(lin[0].weight)
        ref.bias.copy_(lin[1].bias)
    x = torch.randn(4, 8, requires_grad=True)
    with fo.settings(fusion=fusion), torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
        y_ref = torch.nn.functional.gelu(ref(x), approximate="tanh")
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref)
    y.float().sum().backward()
    assert lin[0].weight.grad.dtype == torch.float32 and lin[1].bias.grad.dtype == torch.float32


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


def test_add_extra_input_dtype_mismatch_rejected_before_any_write():
    seq = fo.Sequential(fo.GroupedLinear(2, 8, 8), fo.AddExtraInput(), fo.GroupedLinear(2, 8, 8))
    buf0 = torch.full((5, 8), 7.0)
    with pytest.raises(ValueError, match="AddExtraInput"):
        seq(
            torch.randn(5, 8),
            [2, 3],
            torch.randn(5, 8, dtype=torch.float64),
            [2, 3],
            op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: buf0}},
        )
    assert bool((buf0 == 7.0).all())


def test_direct_call_leaves_no_reference_cycle():
    op = fo.GroupedLinear(2, 4, 4)
    op(torch.randn(3, 4), [1, 2])
    ref = weakref.ref(op.weight)
    gc.disable()
    try:
        del op
        assert ref() is None
    finally:
        gc.enable()


def test_parameter_modified_between_forward_and_backward_is_an_error():
    lin = fo.GroupedLinear(2, 4, 4)
    y = lin(torch.randn(3, 4, requires_grad=True), [1, 2])
    with torch.no_grad():
        lin.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("fusion", [True, False])
def test_unfreezing_a_parameter_between_forward_and_backward_is_an_error(fusion):
    torch.manual_seed(0)
    seq = fo.Sequential(fo.GroupedLinear(2, 4, 8), fo.ScaledSwiGLU(), fo.GroupedLinear(2, 4, 4))
    seq[0].weight.requires_grad_(False)
    x = torch.randn(3, 4, requires_grad=True)
    probs = torch.rand(3)
    grad_buf = torch.full((3, 4), 7.0)
    optimizer = torch.optim.Adam(seq.parameters())
    for p in seq.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # the optimizer holds state
    optimizer.zero_grad(set_to_none=True)
    state_before = [v.clone() for st in optimizer.state.values() for v in st.values()]
    params_before = [p.detach().clone() for p in seq.parameters()]
    with fo.settings(fusion=fusion):
        y = seq(x, [1, 2], probs, [1, 2], op_kwargs={0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}})
    seq[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="GroupedLinear: parameter 'weight' was set to require grad after"):
        y.sum().backward()
    assert torch.all(grad_buf == 7.0) and x.grad is None
    assert all(torch.equal(a, b) for a, b in zip(seq.parameters(), params_before))
    state_after = [v for st in optimizer.state.values() for v in st.values()]
    assert all(torch.equal(a, b) for a, b in zip(state_after, state_before))
    assert seq[0].weight.grad is None and seq[2].weight.grad is None
    with fo.settings(fusion=fusion):  # the next call, with the flag set before forward, works
        seq(x, [1, 2], probs, [1, 2]).sum().backward()
    assert seq[0].weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("value", [4.0, "4", True, None])
def test_constructor_sizes_must_be_ints(value):
    with pytest.raises(TypeError, match="GroupedLinear: num_groups must be an int"):
        fo.GroupedLinear(value, 4, 4)
    with pytest.raises(TypeError, match="BasicLinear: in_features must be an int"):
        fo.BasicLinear(value, 4)
    with pytest.raises(TypeError, match="Bias: features must be an int"):
        fo.Bias(value)


@pytest.mark.parametrize("where", ["input", "split sizes"])
@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_meta_and_sparse_tensors_get_a_clear_error(where, kind):
    torch.manual_seed(0)
    lin = fo.GroupedLinear(2, 4, 4)
    weight = lin.weight.detach().clone()
    x, splits = torch.randn(3, 4), torch.tensor([1, 2])
    bad = {"input": x, "split sizes": splits}[where]
    bad = bad.to("meta") if kind == "meta" else bad.to_sparse()
    x, splits = (bad, splits) if where == "input" else (x, bad)
    out_buf = torch.full((3, 4), 7.0)
    match = "meta tensor" if kind == "meta" else "layout torch.sparse_coo"
    with pytest.raises(ValueError, match=f"GroupedLinear: .*{match}"):
        lin(x, splits, output=out_buf)
    assert torch.all(out_buf == 7.0) and torch.equal(lin.weight, weight)
    assert lin(torch.randn(3, 4), [1, 2], output=out_buf).data_ptr() == out_buf.data_ptr()


def test_split_sizes_written_through_numpy_between_calls_are_read_again():
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    lin = fo.GroupedLinear(2, 4, 4)
    x = torch.randn(4, 4)
    sizes_np = np.array([1, 3])
    splits = torch.from_numpy(sizes_np)  # shares memory: numpy writes bump no version counter
    lin(x, splits)
    sizes_np[:] = [3, 1]
    got = lin(x, splits)
    want = torch.cat([x[:3] @ lin.weight[0].T, x[3:] @ lin.weight[1].T]).detach()
    torch.testing.assert_close(got, want)
