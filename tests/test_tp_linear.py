"""tp_linear_forward on plain tensors: dispatch, numerics (float64 reference), bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_model import rounding_rtol
from hypothesis import given, settings
from hypothesis import strategies as st

import fusible_ops.basic.linear_dispatch as tp_linear
from fusible_ops.parallel import (
    PATH_ASYNC_TP,
    PATH_BMM,
    PATH_LINEAR,
    PATH_MM,
    select_tp_linear_path,
    tp_linear_forward,
)

# Against float64: the reductions are over in_features (8) forward and dgrad, and over the
# rows (<= 12) for wgrad; atol is the error of an entry near zero, relative to the sum of
# |terms| of 8 unit-normal products (< 8). bf16 rounds the result and the incoming
# gradient once each (GEMMs accumulate in float32).
TOLERANCES = {
    torch.float64: dict(atol=8 * rounding_rtol(torch.float64, 12), rtol=rounding_rtol(torch.float64, 12, 4)),
    torch.float32: dict(atol=8 * rounding_rtol(torch.float32, 12), rtol=rounding_rtol(torch.float32, 12, 4)),
    torch.bfloat16: dict(atol=8 * rounding_rtol(torch.bfloat16, 2), rtol=rounding_rtol(torch.bfloat16, 2, 2)),
}
SHAPES = {1: (8,), 2: (5, 8), 3: (2, 3, 8), 4: (2, 2, 3, 8)}


def reference_linear(x, weight, bias):
    """``x @ weight.T + bias`` written out in float64."""
    out = (x.double().unsqueeze(-2) * weight.double()).sum(-1)
    return out if bias is None else out + bias.double()


def make_args(ndim, bias, dtype, *, non_contiguous=False, rows=None):
    shape = SHAPES[ndim] if rows is None else (rows, 8)
    if non_contiguous:
        x = torch.randn(*shape[:-1], 16, dtype=dtype)[..., ::2]
        assert not x.is_contiguous()
    else:
        x = torch.randn(shape, dtype=dtype)
    weight = torch.randn(6, 8, dtype=dtype)
    b = torch.randn(6, dtype=dtype) if bias else None
    return x.requires_grad_(), weight.requires_grad_(), b.requires_grad_() if bias else None


def check_against_reference(out, x, weight, bias):
    """Forward and backward of ``sum(out * g)`` against the float64 reference."""
    tol = TOLERANCES[x.dtype]
    g = torch.randn(out.shape, dtype=torch.float64)
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    ref = reference_linear(x64, w64, b64)
    assert out.dtype == x.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, **tol)
    (ref * g).sum().backward()
    (out.double() * g).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(weight.grad.double(), w64.grad, **tol)
    if bias is not None:
        torch.testing.assert_close(bias.grad.double(), b64.grad, **tol)


@pytest.fixture
def path_spy(monkeypatch):
    """Records which implementation each tp_linear_forward call ran."""
    calls = []

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(tp_linear, "_async_tp_linear", spy(PATH_ASYNC_TP, tp_linear._async_tp_linear))
    monkeypatch.setattr(tp_linear, "_bmm_linear", spy(PATH_BMM, tp_linear._bmm_linear))
    monkeypatch.setattr(tp_linear, "_mm_linear", spy(PATH_MM, tp_linear._mm_linear))
    monkeypatch.setattr(tp_linear.F, "linear", spy(PATH_LINEAR, F.linear))
    return calls


@pytest.fixture
def micro_pipeline_tp():
    """Set Inductor's async-TP flag; yields a setter. Dynamo is reset so no cached graph leaks."""
    import torch._inductor.config as inductor_config

    saved = inductor_config._micro_pipeline_tp
    torch._dynamo.reset()

    def set_flag(value: bool) -> None:
        inductor_config._micro_pipeline_tp = value

    yield set_flag
    inductor_config._micro_pipeline_tp = saved
    torch._dynamo.reset()


class GraphCapture:
    """A torch.compile backend that keeps each Dynamo graph and runs it eagerly."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self) -> list:
        return [n.target for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


# ----------------------------------------------------------------------------- eager
@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_eager_uses_f_linear_whatever_the_flag(path_spy, micro_pipeline_tp, ndim, flag):
    micro_pipeline_tp(flag)
    assert tp_linear._is_async_tp_linear_enabled() is False
    x, w, b = make_args(ndim, True, torch.float32)
    for mm_for_2d in (False, True):
        assert select_tp_linear_path(x, mm_for_2d) == PATH_LINEAR
        tp_linear_forward(x, w, b, mm_for_2d)
    assert path_spy == [PATH_LINEAR, PATH_LINEAR]


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_eager_matches_reference(ndim, bias, dtype):
    x, w, b = make_args(ndim, bias, dtype)
    check_against_reference(tp_linear_forward(x, w, b, True), x, w, b)


@pytest.mark.parametrize("path", ["async_tp", "bmm", "mm"])
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("bias", [True, False])
def test_each_implementation_matches_reference(path, bias, dtype):
    """The three non-default implementations, called directly (they are what compile runs)."""
    ndim = 2 if path == "mm" else 3
    x, w, b = make_args(ndim, bias, dtype, non_contiguous=True)
    fn = {"async_tp": tp_linear._async_tp_linear, "bmm": tp_linear._bmm_linear, "mm": tp_linear._mm_linear}
    check_against_reference(fn[path](x, w, b), x, w, b)


@pytest.mark.parametrize("ndim", [2, 3, 4])
def test_zero_tokens(ndim):
    shape = (0,) * (ndim - 1) + (8,)
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    out = tp_linear_forward(x, w, b, True)
    assert out.shape == shape[:-1] + (6,)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    in_features=st.integers(1, 9),
    out_features=st.integers(1, 9),
    bias=st.booleans(),
    path=st.sampled_from(["forward", "async_tp", "bmm", "mm"]),
)
def test_any_shape_matches_reference(lead, in_features, out_features, bias, path):
    if path == "bmm":
        lead = (lead + [2, 2])[:2]
    elif path == "mm":
        lead = (lead + [3])[:1]
    x = torch.randn(*lead, in_features, dtype=torch.float64, requires_grad=True)
    w = torch.randn(out_features, in_features, dtype=torch.float64, requires_grad=True)
    b = torch.randn(out_features, dtype=torch.float64, requires_grad=True) if bias else None
    fn = {
        "forward": lambda x, w, b: tp_linear_forward(x, w, b, False),
        "async_tp": tp_linear._async_tp_linear,
        "bmm": tp_linear._bmm_linear,
        "mm": tp_linear._mm_linear,
    }[path]
    check_against_reference(fn(x, w, b), x, w, b)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "x_shape, w_shape, b_shape, message",
    [
        ((4, 7), (6, 8), None, "does not end in in_features=8"),
        ((4, 8), (6, 8, 1), None, "weight must be 2-D"),
        ((4, 8), (6, 8), (5,), r"bias must have shape \(6,\)"),
        ((4, 8), (6, 8), (6, 1), r"bias must have shape \(6,\)"),
        ((), (6, 8), None, "does not end in in_features"),
    ],
)
def test_bad_input_raises(x_shape, w_shape, b_shape, message):
    b = torch.randn(b_shape) if b_shape is not None else None
    with pytest.raises(ValueError, match=f"tp_linear_forward: .*{message}"):
        tp_linear_forward(torch.randn(x_shape), torch.randn(w_shape), b, True)


# ----------------------------------------------------------------------------- compiled
@pytest.mark.parametrize("mm_for_2d", [True, False])
@pytest.mark.parametrize("ndim", [2, 3, 4])
@pytest.mark.parametrize("flag", [False, True])
def test_compiled_path_and_graph(micro_pipeline_tp, ndim, flag, mm_for_2d):
    """Flag on: the native linear graph (F.linear, no bmm/mm). Flag off: bmm for 3-D, mm for 2-D."""
    micro_pipeline_tp(flag)
    capture = GraphCapture()
    seen = []

    def fn(x, w, b):
        seen.append(select_tp_linear_path(x, mm_for_2d))
        return tp_linear_forward(x, w, b, mm_for_2d)

    x, w, b = make_args(ndim, True, torch.float32)
    out = torch.compile(fn, backend=capture, fullgraph=True)(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b))
    targets = capture.targets()
    if flag:
        expected = PATH_ASYNC_TP
    elif ndim == 3:
        expected = PATH_BMM
    elif ndim == 2 and mm_for_2d:
        expected = PATH_MM
    else:
        expected = PATH_LINEAR
    assert seen == [expected]
    assert (torch.bmm in targets) == (expected == PATH_BMM)
    assert (torch.mm in targets) == (expected == PATH_MM)
    assert (F.linear in targets) == (expected in (PATH_ASYNC_TP, PATH_LINEAR))
    if expected == PATH_ASYNC_TP:
        # the bias is added after a bias-free linear, so the mm never becomes an addmm
        linear_node = next(n for n in capture.graphs[0].graph.nodes if n.target is F.linear)
        assert len(linear_node.args) == 2 and not linear_node.kwargs


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ndim", [2, 3, 4])
def test_compiled_matches_reference(micro_pipeline_tp, ndim, bias, flag):
    """aot_eager forward and backward, through the path the flag selects."""
    micro_pipeline_tp(flag)
    x, w, b = make_args(ndim, bias, torch.float64)
    out = torch.compile(lambda x, w, b: tp_linear_forward(x, w, b, True), backend="aot_eager")(x, w, b)
    check_against_reference(out, x, w, b)


def test_async_tp_aten_graph_is_reshape_mm_reshape(micro_pipeline_tp):
    """With the flag on, a 3-D linear lowers to view -> mm -> view then add (no addmm, no bmm)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    micro_pipeline_tp(True)
    aten_targets = []

    def capture_aten(gm, example_inputs):
        def fw(fw_gm, _):
            aten_targets.extend(n.target for n in fw_gm.graph.nodes if n.op == "call_function")
            return fw_gm.forward

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    x, w, b = make_args(3, True, torch.float32)
    with torch.no_grad():
        torch.compile(lambda x, w, b: tp_linear_forward(x, w, b, True), backend=capture_aten)(x, w, b)
    aten = torch.ops.aten
    assert aten.mm.default in aten_targets
    assert aten.addmm.default not in aten_targets and aten.bmm.default not in aten_targets
    mm_index = aten_targets.index(aten.mm.default)
    assert aten_targets[mm_index - 1] in (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
    assert aten.add.Tensor in aten_targets[mm_index + 1 :]
