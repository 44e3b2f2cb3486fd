"""What a user's extension can get wrong is refused with an error naming it.

Backends (``register_backend``): the conformance probe at registration and the per-call
checks of each hook's result. Fused ops (``register_fusion``): a missing gradient for a
parameter that requires grad. ``window_rule``'s arguments. The checkpoint loaders'
``names`` and per-group key shapes.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_backend_conformance import ThinLoopBackend

import fusible_ops as fo
from fusible_ops import MoE
from fusible_ops.checkpoint import export_grouped_keys, load_grouped_keys, load_per_expert_state_dict
from fusible_ops.kernels import (
    BackendConformanceError,
    backend_names,
    get_backend,
    register_backend,
    select_backend,
    unregister_backend,
)
from fusible_ops.kernels.activation import ActivationSpec
from fusible_ops.kernels.conformance import run_conformance_probe

# ---------------------------------------------------------------- backends


class _LoopHooks(ThinLoopBackend):
    """A correct user backend: the torch loop's hooks behind the base class."""

    name = "user_loop"


class _NeverWritesOut(_LoopHooks):
    """Computes into fresh memory and hands back the caller's ``out`` unwritten."""

    def _fprop(self, x, weight, split_sizes, offsets, bias, out):
        y = self._loop._fprop(x, weight, split_sizes, offsets, bias, None)
        return y if out is None else out


class _WrongDgrad(_LoopHooks):
    def _dgrad(self, grad_out, weight, split_sizes, offsets, out):
        return super()._dgrad(grad_out, weight, split_sizes, offsets, out).mul_(1.01)


class _WrongShapeWithoutOut(_LoopHooks):
    def _fprop(self, x, weight, split_sizes, offsets, bias, out):
        y = super()._fprop(x, weight, split_sizes, offsets, bias, out)
        return y if out is not None else y[:, :-1]


class _WritesTailRows(_LoopHooks):
    def _fprop(self, x, weight, split_sizes, offsets, bias, out):
        y = super()._fprop(x, weight, split_sizes, offsets, bias, out)
        return y.nan_to_num_(0.0)


class _EmptyGroupNotZeroed(_LoopHooks):
    def _wgrad(self, grad_out, x, split_sizes, offsets, out):
        if out is None:
            return super()._wgrad(grad_out, x, split_sizes, offsets, None)
        for group, rows in zip(range(len(split_sizes)), split_sizes):
            if rows:  # skips the empty group instead of zeroing it
                start = sum(split_sizes[:group])
                out[group] = grad_out[start : start + rows].T @ x[start : start + rows]
        return out


class _FusedForgetsScales(_LoopHooks):
    fused_activation = True

    def _fc1_fprop_act(self, x, weight, bias, split_sizes, offsets, activation, scales):
        return self._composed_fc1_fprop_act(x, weight, bias, split_sizes, offsets, activation, None)


class _RaisesInWgrad(_LoopHooks):
    def _wgrad(self, grad_out, x, split_sizes, offsets, out):
        raise NotImplementedError("wgrad is not written yet")


@pytest.fixture
def registry_restored():
    """Unregisters whatever a test registered."""
    before = set(backend_names())
    yield
    for name in set(backend_names()) - before:
        unregister_backend(name)


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (_NeverWritesOut, r"fprop on cpu torch\.float32 \(host split sizes, out given\) did not write out: "),
        (_WrongDgrad, r"dgrad on cpu torch\.float32 .* computed wrong values in out: "),
        (
            _WrongShapeWithoutOut,
            r"fprop on cpu torch\.float32 \(device offsets only, no out\) raised .*shape",
        ),
        (_WritesTailRows, r"fprop .* wrote rows 8\.\. of out, past the last group"),
        (_EmptyGroupNotZeroed, r"wgrad .* did not write out: .* still hold the NaN"),
        (
            _FusedForgetsScales,
            r"fc1_fprop_act on cpu torch\.float32 \(swiglu, scaled, .* wrong values in act",
        ),
        (_RaisesInWgrad, r"wgrad on cpu torch\.float32 .* raised NotImplementedError: wgrad is not written"),
    ],
    ids=lambda v: v.__name__.strip("_") if isinstance(v, type) else "",
)
def test_a_backend_that_breaks_its_contract_is_refused_at_registration(registry_restored, cls, message):
    with pytest.raises(
        BackendConformanceError, match=r"^backend 'broken' failed the conformance probe: " + message
    ):
        register_backend("broken", cls, prefer_on=("cpu",))
    assert isinstance(BackendConformanceError("x"), ValueError)
    assert "broken" not in backend_names()
    assert select_backend(torch.device("cpu"), torch.float32).name == "cpu"


def test_a_correct_backend_and_the_librarys_own_pass_the_probe(registry_restored):
    register_backend("user_loop", _LoopHooks)
    assert get_backend("user_loop").check_hook_results  # a user's backend: checked per call
    for name in ("torch_loop", "cpu"):
        assert not get_backend(name).check_hook_results  # the library's own: trusted
        probed = run_conformance_probe(name, type(get_backend(name))())
        assert {dtype for _, dtype in probed} >= {torch.float32, torch.float64, torch.bfloat16}


def test_a_backend_given_by_module_path_is_probed_when_first_used(registry_restored):
    register_backend("broken_by_path", __name__, "_NeverWritesOut")  # nothing imported yet
    for _ in range(2):  # refused on every use, not only the first
        with pytest.raises(BackendConformanceError, match=r"^backend 'broken_by_path' .* did not write out"):
            get_backend("broken_by_path")
    register_backend("loop_by_path", __name__, "_LoopHooks")
    assert isinstance(get_backend("loop_by_path"), _LoopHooks)


def test_a_backend_that_cannot_run_here_registers_unprobed(registry_restored):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the probe runs there")

    class CudaOnly(_NeverWritesOut):
        def probe(self, device, dtype):
            return None if device.type == "cuda" else "CUDA only"

    register_backend("cuda_only", CudaOnly)  # nothing to run the probe on
    assert "cuda_only" in backend_names()


def _gemm_operands():
    x, weight = torch.randn(8, 16), torch.randn(2, 32, 16)
    offsets = torch.tensor([3, 8], dtype=torch.int32)
    return x, weight, [3, 5], offsets


def test_per_call_checks_catch_a_wrong_shape_and_a_result_that_is_not_out(registry_restored):
    class NotOut(_LoopHooks):
        def _fprop(self, x, weight, split_sizes, offsets, bias, out):
            return super()._fprop(x, weight, split_sizes, offsets, bias, None)  # fresh memory, out untouched

    register_backend("wrong_shape", _WrongShapeWithoutOut, probe=False)  # the caller's responsibility
    register_backend("not_out", NotOut, probe=False)
    x, weight, split_sizes, offsets = _gemm_operands()
    with pytest.raises(
        RuntimeError, match=r"^user_loop\._fprop: returned a torch\.float32 tensor of shape \[8, 31\]"
    ):
        get_backend("wrong_shape").fprop(x, weight, split_sizes, offsets)
    out = torch.full((8, 32), 7.0)
    with pytest.raises(
        RuntimeError, match=r"^user_loop\._fprop: was given out= of shape \[8, 32\] but returned another"
    ):
        get_backend("not_out").fprop(x, weight, split_sizes, offsets, out=out)
    # through the public API: an error naming the backend's hook, not a broadcast error deep in torch
    layer = fo.GroupedLinear(2, 16, 32)
    with (
        fo.settings(backend="wrong_shape"),
        pytest.raises(RuntimeError, match=r"user_loop\._fprop: returned"),
    ):
        layer(x, split_sizes)


def test_per_call_checks_of_the_fused_hooks(registry_restored):
    class FusedWrongWidth(_LoopHooks):
        fused_activation = True

        def _fc1_fprop_act(self, x, weight, bias, split_sizes, offsets, activation, scales):
            pre, act = self._composed_fc1_fprop_act(x, weight, bias, split_sizes, offsets, activation, scales)
            return pre, torch.cat([act, act], dim=1)  # gated: act must be half as wide as pre

    register_backend("fused_wrong_width", FusedWrongWidth, probe=False)
    x, weight, split_sizes, offsets = _gemm_operands()
    with pytest.raises(
        RuntimeError, match=r"^user_loop\._fc1_fprop_act: returned .* \[8, 32\] as item 1; .*\[8, 16\]"
    ):
        get_backend("fused_wrong_width").fc1_fprop_act(
            x, weight, None, split_sizes, offsets, ActivationSpec("swiglu"), None
        )


# ---------------------------------------------------------------- fused ops: missing parameter gradients


class _LinearReLU(fo.FusedOperation):
    """``relu(x @ w.T)`` over (BasicLinear, ReLU); ``drop`` says how its backward loses grad_weight."""

    drop = "none"
    calls = 0

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        y = torch.relu(input_ @ ctx.params["weight"].T)
        ctx.save_for_backward(input=input_, mask=y > 0)
        return fo.FusedForward(y, [(), ()])

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        type(self).calls += 1
        grad_pre = grad_output * ctx.saved["mask"]
        grad_input = grad_pre @ ctx.params["weight"]
        grad_weight = grad_pre.T @ ctx.saved["input"]
        if self.drop == "none" or (self.drop == "second_call" and type(self).calls < 2):
            return fo.FusedBackward(grad_input, [[grad_weight], []], [(), ()])
        if self.drop == "empty_list":
            return fo.FusedBackward(grad_input, [[], []], [(), ()])
        return fo.FusedBackward(grad_input, [[None], []], [(), ()])


def _run_with_fused(drop: str, *, calls: int = 1, freeze: bool = False):
    fused = type("LinearReLU", (_LinearReLU,), {"drop": drop, "calls": 0})
    rule = fo.window_rule("linear_relu_test", (fo.BasicLinear, fo.ReLU), lambda ctx, ops, first: fused(ops))
    seq = fo.Sequential(fo.BasicLinear(4, 3), fo.ReLU())
    seq[0].weight.requires_grad_(not freeze)
    x = torch.randn(6, 4, requires_grad=True)
    fo.register_fusion(rule, kind="joint")
    try:
        for _ in range(calls):
            seq(x).sum().backward()
    finally:
        fo.unregister_fusion(rule)
    return seq, x


@pytest.mark.parametrize("drop", ["none_grad", "empty_list"])
def test_a_fused_backward_without_a_needed_weight_gradient_is_an_error(drop):
    message = (
        r"^LinearReLU\.fuser_backward returned no gradient \(None\) for parameter 'weight' of basic op 0, "
        r"op 0 \(BasicLinear\), which requires grad"
    )
    with pytest.raises(RuntimeError, match=message):
        _run_with_fused(drop)


def test_the_missing_gradient_check_runs_on_every_call_of_a_users_op():
    with pytest.raises(RuntimeError, match=r"no gradient \(None\) for parameter 'weight'"):
        _run_with_fused("second_call", calls=2)


def test_no_gradient_for_a_frozen_weight_is_fine():
    seq, x = _run_with_fused("none_grad", freeze=True)
    assert seq[0].weight.grad is None and x.grad is not None


def test_a_basic_op_backward_without_its_weight_gradient_is_an_error():
    class Gain(fo.BasicOperation):
        param_names = ("weight",)

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

        def op_forward(self, ctx, input_):
            ctx.save_for_backward(input=input_)
            return input_ * ctx.params["weight"]

        def op_backward(self, ctx, grad_output):
            return fo.OpBackward(grad_output * ctx.params["weight"], [None])

    op = Gain()
    with pytest.raises(
        RuntimeError, match=r"^Gain\.op_backward returned no gradient \(None\) for parameter 'weight'"
    ):
        fo.Sequential(op)(torch.randn(2, 3)).sum().backward()
    assert op.weight.grad is None


# ---------------------------------------------------------------- window_rule and register_fusion arguments


def _build(ctx, ops, first):
    return "never"


@pytest.mark.parametrize(
    ("pattern", "build", "error", "message"),
    [
        ((), _build, ValueError, r"window_rule\('r'\): pattern is empty"),
        ([], _build, ValueError, r"window_rule\('r'\): pattern is empty"),
        ((fo.BasicLinear, "ReLU"), _build, TypeError, r"window_rule\('r'\): pattern entry 1 is 'ReLU'"),
        ((torch.nn.Linear,), _build, TypeError, r"pattern entry 0 .* expected a BasicOperation subclass"),
        ((fo.BasicLinear, ()), _build, TypeError, r"pattern entry 1 is \(\)"),
        ((fo.BasicLinear, (fo.ReLU, int)), _build, TypeError, r"pattern entry 1 is"),
        (fo.BasicLinear, _build, TypeError, r"pattern must be a sequence of basic-op classes"),
        ((fo.BasicLinear,), "build", TypeError, r"window_rule\('r'\): build must be callable"),
    ],
)
def test_window_rule_arguments_are_checked(pattern, build, error, message):
    with pytest.raises(error, match=message):
        fo.window_rule("r", pattern, build)


def test_register_fusion_refuses_a_rule_that_is_not_callable():
    with pytest.raises(TypeError, match=r"register_fusion: rule must be a callable"):
        fo.register_fusion("linear_relu", kind="joint")


# ---------------------------------------------------------------- checkpoint loaders

E, H, F = 4, 6, 3


@pytest.mark.parametrize("activation", ["swiglu", "srelu"])
@pytest.mark.parametrize(
    "names", [("w1", "w2"), ("w1", "w3", "w2", "w4"), ("w1", "w1", "w2"), ("w1", "", "w2"), "w1w3w2"]
)
def test_load_per_expert_state_dict_checks_names(activation, names):
    moe = MoE(H, F, E, 2, activation=activation, dtype=torch.float64)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    hint = r"e\.g\. \(\"w1\", \"w3\", \"w2\"\)"
    if activation == "srelu":
        hint = r"the experts' activation is not gated, so the up name is not read .* " + hint
    message = r"^load_per_expert_state_dict: names must be a tuple of three distinct non-empty strings, "
    with pytest.raises(
        ValueError, match=message + r"the \(gate, up, down\) projection names; got .*; " + hint
    ):
        load_per_expert_state_dict(moe, {}, names=names)
    assert all(torch.equal(v, before[k]) for k, v in moe.state_dict().items())


def test_load_per_expert_state_dict_non_gated_with_three_names():
    moe = MoE(H, F, E, 2, activation="srelu", dtype=torch.float64)
    gate, down = torch.randn(E, F, H, dtype=torch.float64), torch.randn(E, H, F, dtype=torch.float64)
    sd = {f"{e}.w1.weight": gate[e] for e in range(E)} | {f"{e}.w2.weight": down[e] for e in range(E)}
    load_per_expert_state_dict(moe, sd, names=("w1", "w3", "w2"))
    assert torch.equal(moe.experts[0].weight.detach(), gate) and torch.equal(
        moe.experts[2].weight.detach(), down
    )


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_load_grouped_keys_names_a_wrong_shaped_key(layout):
    experts = fo.Sequential(
        fo.GroupedLinear(E, H, 2 * F, weight_layout=layout, dtype=torch.float64),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(E, F, H, weight_layout=layout, dtype=torch.float64),
    )
    sd = export_grouped_keys(experts)
    before = {k: v.clone() for k, v in experts.state_dict().items()}
    good = sd["experts.2.weight1"]
    for bad in (good.T.contiguous(), good[:, :-1], good.reshape(-1)):
        sd["experts.2.weight1"] = bad
        expected = re.escape(str(list(good.shape)))
        with pytest.raises(
            ValueError, match=rf"^checkpoint: experts\.2\.weight1 has shape .*; expected {expected}"
        ):
            load_grouped_keys(experts, sd)
        assert all(torch.equal(v, before[k]) for k, v in experts.state_dict().items())
