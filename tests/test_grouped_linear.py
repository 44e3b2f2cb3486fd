"""GroupedLinear against reference_ops.grouped_linear (a per-row einsum, no loop over groups).

Tolerances relative to the largest reference magnitude: float64 also by gradcheck;
float32 1e-5; bfloat16 3e-2.
"""

from __future__ import annotations

import math

import pytest
import reference_ops as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusible_ops as fo

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}
SPLITS = {
    "uneven_with_empty": [3, 0, 5, 2],
    "all_in_one": [0, 10, 0, 0],
    "empty_first_and_last": [0, 6, 4, 0],
}
SPLIT_FORMS = {
    "list": lambda s: list(s),
    "cpu_int64": lambda s: torch.tensor(s, dtype=torch.int64),
    "cpu_int32": lambda s: torch.tensor(s, dtype=torch.int32),
}


def make_op(bias: bool, dtype=torch.float64, groups: int = 4, k: int = 5, n: int = 3) -> fo.GroupedLinear:
    op = fo.GroupedLinear(groups, k, n, bias=bias, dtype=dtype)
    if bias:
        with torch.no_grad():
            op.bias.uniform_(-1, 1)
    return op


def functional(op: fo.GroupedLinear, split_sizes):
    names = ["weight"] + (["bias"] if op.bias is not None else [])
    return lambda x, *params: torch.func.functional_call(op, dict(zip(names, params)), (x, split_sizes))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("splits", list(SPLITS))
def test_gradcheck_float64(splits, bias):
    op = make_op(bias)
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    params = [ref.leaf(op.weight)] + ([ref.leaf(op.bias)] if bias else [])
    assert torch.autograd.gradcheck(functional(op, SPLITS[splits]), (x, *params))


@pytest.mark.parametrize("backend", ["auto", "torch_loop"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", list(SPLIT_FORMS))
def test_matches_reference(form, dtype, backend):
    op = make_op(bias=True, dtype=dtype)
    sizes = SPLITS["uneven_with_empty"]
    x = torch.randn(10, 5).to(dtype).requires_grad_()
    with fo.settings(backend=backend):
        y = op(x, SPLIT_FORMS[form](sizes))
        dy = torch.randn(y.shape).to(dtype)
        y.backward(dy)
    assert y.dtype == dtype and y.shape == (10, 3)
    x_ref, w_ref, b_ref = ref.leaf(x), ref.leaf(op.weight), ref.leaf(op.bias)
    y_ref = ref.grouped_linear(x_ref, w_ref, b_ref, sizes)
    y_ref.backward(dy.to(torch.float64))
    for name, actual, expected in (
        ("output", y, y_ref),
        ("grad input", x.grad, x_ref.grad),
        ("grad weight", op.weight.grad, w_ref.grad),
        ("grad bias", op.bias.grad, b_ref.grad),
    ):
        assert actual.dtype == dtype, name
        err = ref.max_rel_err(actual, expected)
        assert err <= TOL[dtype], f"{name}: {err:.3g} > {TOL[dtype]}"
    assert torch.all(op.weight.grad[1] == 0) and torch.all(op.bias.grad[1] == 0)  # the empty group


@pytest.mark.parametrize("bias", [False, True])
def test_zero_rows_total_gives_zero_param_grads(bias):
    op = make_op(bias, dtype=torch.float32)
    x = torch.zeros(0, 5, requires_grad=True)
    y = op(x, [0, 0, 0, 0])
    assert y.shape == (0, 3)
    y.sum().backward()
    assert x.grad.shape == (0, 5)
    assert op.weight.grad is not None and torch.equal(op.weight.grad, torch.zeros_like(op.weight))
    if bias:
        assert op.bias.grad is not None and torch.equal(op.bias.grad, torch.zeros_like(op.bias))


def test_batch_seq_hidden_input_and_non_contiguous():
    op = make_op(bias=True)
    x = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)  # 10 token rows
    sizes = SPLITS["uneven_with_empty"]
    y = op(x, sizes)
    assert y.shape == (2, 5, 3)
    torch.testing.assert_close(y, ref.grouped_linear(x.detach(), op.weight.detach(), op.bias.detach(), sizes))
    assert torch.autograd.gradcheck(lambda x: op(x, sizes), (x,))

    base = torch.randn(5, 20, dtype=torch.float64)
    xt = base.t()[:, :5].detach().requires_grad_()  # [20, 5] -> [10, 5] slice of a transpose
    xt = xt[::2]
    assert not xt.is_contiguous() and xt.shape == (10, 5)
    torch.testing.assert_close(
        op(xt, sizes), ref.grouped_linear(xt.detach(), op.weight.detach(), op.bias.detach(), sizes)
    )
    assert torch.autograd.gradcheck(lambda x: op(x, sizes), (xt,))


@pytest.mark.parametrize(
    "split_sizes,message",
    [
        ([3, 5, 2], r"split_sizes has length 3; expected 4"),
        (torch.tensor([3, 5, 2]), r"split_sizes must be 1-D of length 4"),
        (torch.tensor([[3, 0], [5, 2]]), r"split_sizes must be 1-D of length 4"),
        ([3, -1, 6, 2], r"split_sizes must be non-negative"),
        (torch.tensor([3, -1, 6, 2]), r"split_sizes must be non-negative"),
        ([3, 0, 5, 3], r"split_sizes sum to 11 but the input has 10 rows"),
        (torch.tensor([3, 0, 5, 1]), r"split_sizes sum to 9 but the input has 10 rows"),
        (
            torch.tensor([3.0, 0.0, 5.0, 2.0]),
            r"split_sizes must be an integer tensor, got dtype torch.float32",
        ),
        ([3.0, 0, 5, 2], r"split_sizes must hold ints"),
        ("3,0,5,2", r"split_sizes must be a 1-D integer tensor or a list of ints"),
    ],
)
def test_bad_split_sizes_are_rejected(split_sizes, message):
    op = make_op(bias=True, dtype=torch.float32)
    weight_before = op.weight.detach().clone()
    x = torch.randn(10, 5, requires_grad=True)
    with pytest.raises(ValueError, match=r"GroupedLinear: " + message):
        op(x, split_sizes)
    assert torch.equal(op.weight, weight_before)
    op(x, [3, 0, 5, 2]).sum().backward()  # a valid call still works
    assert x.grad is not None


def test_bad_input_is_rejected():
    op = make_op(bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"GroupedLinear: input has shape \[10, 4\]; expected \[\.\.\., 5\]"):
        op(torch.randn(10, 4), [3, 0, 5, 2])
    with pytest.raises(ValueError, match="dtype torch.float64 does not match the weight dtype torch.float32"):
        op(torch.randn(10, 5, dtype=torch.float64), [3, 0, 5, 2])
    with pytest.raises(ValueError, match="positive"):
        fo.GroupedLinear(0, 5, 3)


def test_state_dict_layout_and_round_trip():
    op = make_op(bias=True, dtype=torch.float32)
    state = op.state_dict()
    assert set(state) == {"weight", "bias"}
    assert state["weight"].shape == (4, 3, 5) and state["bias"].shape == (4, 3)
    other = make_op(bias=True, dtype=torch.float32)
    assert not torch.equal(other.weight, op.weight)
    other.load_state_dict(state)
    assert torch.equal(other.weight, op.weight) and torch.equal(other.bias, op.bias)


def test_load_per_group_keys():
    op = make_op(bias=True, dtype=torch.float32)
    per_group = {f"weight{g}": torch.randn(3, 5) for g in range(4)}
    per_group.update({f"bias{g}": torch.randn(3) for g in range(4)})
    result = op.load_state_dict(per_group)
    assert not result.missing_keys and not result.unexpected_keys
    for g in range(4):
        assert torch.equal(op.weight[g], per_group[f"weight{g}"])
        assert torch.equal(op.bias[g], per_group[f"bias{g}"])

    # nested in a Sequential the keys carry the module prefix
    seq = fo.Sequential(fo.ReLU(), make_op(bias=False, dtype=torch.float32))
    nested = {f"1.weight{g}": torch.full((3, 5), float(g)) for g in range(4)}
    seq.load_state_dict(nested)
    assert torch.equal(seq[1].weight[:, 0, 0], torch.arange(4.0))

    # an incomplete per-group set is not silently accepted
    with pytest.raises(RuntimeError, match="weight"):
        make_op(bias=False, dtype=torch.float32).load_state_dict(
            {f"weight{g}": torch.randn(3, 5) for g in range(3)}
        )


def test_reset_parameters_and_extra_repr():
    op = fo.GroupedLinear(3, 16, 4, bias=True)
    bound = 1.0 / math.sqrt(16)
    assert op.weight.abs().max() <= bound and op.bias.abs().max() <= bound
    assert not torch.equal(op.weight[0], op.weight[1])  # each group initialised on its own
    with torch.no_grad():
        op.weight.zero_()
        op.bias.zero_()
    op.reset_parameters()
    assert op.weight.abs().max() > 0 and op.bias.abs().max() > 0
    assert op.extra_repr() == "num_groups=3, in_features=16, out_features=4, bias=True"
    assert "GroupedLinear(num_groups=3" in repr(op)
    assert fo.GroupedLinear(2, 3, 4).bias is None


@settings(max_examples=20, deadline=None)
@given(
    split_sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    bias=st.booleans(),
    leading=st.sampled_from(["rows", "batch"]),
)
def test_random_splits_property(split_sizes, bias, leading):
    groups, rows = len(split_sizes), sum(split_sizes)
    op = fo.GroupedLinear(groups, 3, 2, bias=bias, dtype=torch.float64)
    shape = (rows, 3) if leading == "rows" or rows % 2 else (2, rows // 2, 3)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    y = op(x, torch.tensor(split_sizes))
    bias_value = op.bias.detach() if bias else None
    torch.testing.assert_close(y, ref.grouped_linear(x.detach(), op.weight.detach(), bias_value, split_sizes))
    (y * y).sum().backward()
    x_ref, w_ref = ref.leaf(x), ref.leaf(op.weight)
    y_ref = ref.grouped_linear(x_ref, w_ref, bias_value, split_sizes)
    (y_ref * y_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(op.weight.grad, w_ref.grad)


def test_the_backend_in_the_plan_entry_is_what_runs(monkeypatch):
    """One source of truth: the plan entry carries the BackendChoice; the call runs it."""
    import fusible_ops.basic.grouped_linear as grouped_linear_module

    seq = fo.Sequential(fo.GroupedLinear(4, 8, 16))
    x, splits = torch.randn(10, 8, requires_grad=True), [3, 0, 4, 3]
    seq(x, splits)
    entry = seq.last_plan.fusion_plans[0].forward[0]
    choice = entry.backend
    assert choice.name == entry.backend_name and choice.backend.name == entry.backend_name
    ran = []
    original = choice.backend.fprop
    monkeypatch.setattr(choice.backend, "fprop", lambda *a, **k: ran.append(1) or original(*a, **k))

    def no_reselection(*args, **kwargs):
        raise AssertionError("the backend was selected again at run time")

    monkeypatch.setattr(grouped_linear_module, "select_backend", no_reselection)
    seq(x, splits).sum().backward()  # the cached plan: nothing is selected again
    assert ran == [1]
