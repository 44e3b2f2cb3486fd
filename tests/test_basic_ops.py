"""Every basic op of DESIGN 6, forward and backward, against the references in reference_ops.py.

Tolerances (largest error relative to the largest reference magnitude): float64 is
also checked with ``torch.autograd.gradcheck``; float32 1e-5; bfloat16 3e-2.
"""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch
from error_model import rounding_rtol
from hypothesis import given, settings
from hypothesis import strategies as st

import fusible_ops as fo

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}

UNARY_OPS = {"relu": fo.ReLU, "gelu": fo.GELU, "silu": fo.SiLU, "srelu": fo.SReLU}
GATED_OPS = {"swiglu": fo.SwiGLU, "geglu": fo.GEGLU, "reglu": fo.ReGLU, "clamped_swiglu": fo.ClampedSwiGLU}
SCALED_OPS = {
    "swiglu": fo.ScaledSwiGLU,
    "geglu": fo.ScaledGEGLU,
    "clamped_swiglu": fo.ScaledClampedSwiGLU,
    "srelu": fo.ScaledSReLU,
}
# clamp limit small enough that randn inputs hit both sides of it
CLAMP = {"limit": 1.5, "alpha": 1.3, "glu_linear_offset": 0.5}
CLAMP_REF = {"limit": 1.5, "alpha": 1.3, "offset": 0.5}


def make_activation(kind: str, interleave: int | None = None, scaled: bool = False):
    table = SCALED_OPS if scaled else {**UNARY_OPS, **GATED_OPS}
    cls = table[kind]
    kwargs = {}
    if kind == "clamped_swiglu":
        kwargs.update(CLAMP)
    if interleave is not None:
        kwargs["glu_interleave_size"] = interleave
    return cls(**kwargs)


def reference_activation(kind: str, x: torch.Tensor, interleave: int | None = None) -> torch.Tensor:
    return ref.activation(kind, x, interleave, **(CLAMP_REF if kind == "clamped_swiglu" else {}))


def check_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = ref.max_rel_err(actual, expected)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]} ({dtype})"


# ---------------------------------------------------------------- activations

GATED_CASES = [(k, i) for k in GATED_OPS for i in (None, 1, 2)]


@pytest.mark.parametrize("kind", list(UNARY_OPS))
def test_unary_activation_gradcheck_and_reference(kind):
    op = make_activation(kind)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(op, (x,))
    y = op(x)
    x_ref = ref.leaf(x)
    y_ref = reference_activation(kind, x_ref)
    check_close(y, y_ref, torch.float64, f"{kind} forward")
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    check_close(x.grad, x_ref.grad, torch.float64, f"{kind} grad")


@pytest.mark.parametrize("kind,interleave", GATED_CASES)
def test_gated_activation_gradcheck_and_reference(kind, interleave):
    op = make_activation(kind, interleave)
    x = (2 * torch.randn(5, 8, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(op, (x,))
    y = op(x)
    assert y.shape == (5, 4)
    x_ref = ref.leaf(x)
    y_ref = reference_activation(kind, x_ref, interleave)
    check_close(y, y_ref, torch.float64, f"{kind} forward")
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    check_close(x.grad, x_ref.grad, torch.float64, f"{kind} grad")


def test_interleave_one_is_the_gpt_oss_layout():
    # columns alternate gate, linear, gate, linear, ...
    x = torch.tensor([[1.0, 10.0, -2.0, 20.0]], dtype=torch.float64)
    y = fo.SwiGLU(glu_interleave_size=1)(x)
    expected = torch.stack([ref.silu(x[:, 0]) * 10.0, ref.silu(x[:, 2]) * 20.0], dim=-1)
    torch.testing.assert_close(y, expected)
    y_halves = fo.SwiGLU()(x)  # first half gate, second half linear
    expected_halves = torch.stack([ref.silu(x[:, 0]) * -2.0, ref.silu(x[:, 1]) * 20.0], dim=-1)
    torch.testing.assert_close(y_halves, expected_halves)


def test_clamped_swiglu_formula_and_defaults():
    op = fo.ClampedSwiGLU()
    assert (op.spec.limit, op.spec.alpha, op.spec.glu_linear_offset) == (7.0, 1.702, 1.0)
    assert op.spec.glu_interleave_size is None
    gate = torch.tensor([-9.0, -1.0, 0.5, 6.9, 7.5, 30.0], dtype=torch.float64)
    linear = torch.tensor([-30.0, -7.5, 0.3, 2.0, 7.5, -1.0], dtype=torch.float64)
    y = op(torch.cat([gate, linear]).unsqueeze(0)).squeeze(0)
    g = gate.clamp(max=7.0)
    lin = linear.clamp(-7.0, 7.0)
    expected = g * torch.sigmoid(1.702 * g) * (lin + 1.0)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    # gradients vanish where the clamp is active
    x = torch.cat([gate, linear]).unsqueeze(0).requires_grad_()
    op(x).sum().backward()
    grad_gate, grad_linear = x.grad[0, :6], x.grad[0, 6:]
    assert grad_gate[4] == 0 and grad_gate[5] == 0 and grad_gate[0] != 0
    assert grad_linear[0] == 0 and grad_linear[4] == 0 and grad_linear[3] != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["silu", "gelu", "swiglu", "clamped_swiglu"])
def test_activation_low_precision(kind, dtype):
    op = make_activation(kind)
    x = torch.randn(9, 8).to(dtype).requires_grad_()
    y = op(x)
    assert y.dtype == dtype
    x_ref = ref.leaf(x)
    y_ref = reference_activation(kind, x_ref)
    check_close(y, y_ref, dtype, f"{kind} forward")
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(dy.to(torch.float64))
    assert x.grad.dtype == dtype
    check_close(x.grad, x_ref.grad, dtype, f"{kind} grad")


def test_gated_odd_last_dim_is_rejected():
    for op in (fo.SwiGLU(), fo.ClampedSwiGLU(), fo.ScaledGEGLU()):
        extra = (torch.ones(4),) if op.num_extra_inputs else ()
        with pytest.raises(ValueError, match=rf"{type(op).__name__}.*last dim \(7\)"):
            op(torch.randn(4, 7), *extra)
    # with interleave k the width must be a multiple of 2k
    with pytest.raises(ValueError, match="multiple of 6"):
        fo.SwiGLU(glu_interleave_size=3)(torch.randn(2, 8))
    with pytest.raises(ValueError, match="glu_interleave_size"):
        fo.SwiGLU(glu_interleave_size=0)


# ---------------------------------------------------------------- scaled activations


SCALED_CASES = [(k, i) for k in SCALED_OPS for i in ((None,) if k == "srelu" else (None, 2))]


@pytest.mark.parametrize("kind,interleave", SCALED_CASES)
def test_scaled_activation_gradcheck_and_reference(kind, interleave):
    op = make_activation(kind, interleave, scaled=True)
    x = (2 * torch.randn(6, 8, dtype=torch.float64)).requires_grad_()
    scales = torch.rand(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(op, (x, scales))
    y = op(x, scales)
    x_ref, s_ref = ref.leaf(x), ref.leaf(scales)
    y_ref = reference_activation(kind, x_ref, interleave) * s_ref[:, None]
    check_close(y, y_ref, torch.float64, f"scaled {kind} forward")
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    check_close(x.grad, x_ref.grad, torch.float64, f"scaled {kind} grad input")
    check_close(scales.grad, s_ref.grad, torch.float64, f"scaled {kind} grad scales")


@pytest.mark.parametrize("kind", list(SCALED_OPS))
def test_scaled_activation_bf16_with_fp32_scales(kind):
    op = make_activation(kind, scaled=True)
    x = torch.randn(10, 8).to(torch.bfloat16).requires_grad_()
    scales = torch.rand(10, dtype=torch.float32, requires_grad=True)
    y = op(x, scales)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(y.shape).to(torch.bfloat16)
    y.backward(dy)
    assert x.grad.dtype == torch.bfloat16 and scales.grad.dtype == torch.float32
    x_ref, s_ref = ref.leaf(x), ref.leaf(scales)
    y_ref = reference_activation(kind, x_ref) * s_ref[:, None]
    y_ref.backward(dy.to(torch.float64))
    check_close(y, y_ref, torch.bfloat16, "forward")
    check_close(x.grad, x_ref.grad, torch.bfloat16, "grad input")
    check_close(scales.grad, s_ref.grad, torch.bfloat16, "grad scales")


def test_scaled_activation_batch_seq_hidden_and_zero_tokens():
    op = fo.ScaledSwiGLU()
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    scales = torch.rand(2, 3, dtype=torch.float64, requires_grad=True)
    y = op(x, scales)
    assert y.shape == (2, 3, 4)
    y_ref = ref.activation("swiglu", x.detach()) * scales.detach()[..., None]
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    assert x.grad.shape == x.shape and scales.grad.shape == scales.shape
    assert torch.autograd.gradcheck(op, (x, scales))

    x0 = torch.zeros(0, 8, requires_grad=True)
    s0 = torch.zeros(0, requires_grad=True)
    y0 = op(x0, s0)
    assert y0.shape == (0, 4)
    y0.sum().backward()
    assert x0.grad.shape == (0, 8) and s0.grad.shape == (0,)


def test_scales_wrong_length_or_type_is_rejected():
    x = torch.randn(4, 8)
    for op in (fo.ScaledSwiGLU(), fo.ScaledSReLU(), fo.Scale()):
        with pytest.raises(ValueError, match=rf"{type(op).__name__}: scales has 3 values.*\(4\)"):
            op(x, torch.ones(3))
        with pytest.raises(ValueError, match="floating point"):
            op(x, torch.ones(4, dtype=torch.int64))
        with pytest.raises(ValueError, match="extra input"):
            op(x)  # missing scales
        assert op(x, torch.ones(4)).shape[0] == 4  # a valid call still works


def test_non_contiguous_inputs():
    base = torch.randn(8, 12, dtype=torch.float64)
    x = base[:, ::2].detach().requires_grad_()  # [8, 6] with stride 2
    assert not x.is_contiguous()
    scales_base = torch.rand(16, dtype=torch.float64)
    scales = scales_base[::2].detach().requires_grad_()
    y = fo.ScaledGEGLU()(x, scales)
    torch.testing.assert_close(y, ref.activation("geglu", x.detach()) * scales.detach()[:, None])
    assert torch.autograd.gradcheck(fo.ScaledGEGLU(), (x, scales))
    xt = torch.randn(6, 8, dtype=torch.float64).t().requires_grad_()  # transposed [8, 6]
    assert torch.autograd.gradcheck(fo.SReLU(), (xt,))
    assert torch.autograd.gradcheck(fo.Scale(), (xt, scales))


# ---------------------------------------------------------------- scaling and pass-through ops


def test_constant_scale_and_scale():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fo.ConstantScale(-2.5), (x,))
    torch.testing.assert_close(fo.ConstantScale(-2.5)(x), -2.5 * x.detach())
    scales = torch.rand(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fo.Scale(), (x, scales))
    y = fo.Scale()(x, scales)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(scales.grad, x.detach().sum(-1))  # d(sum x*s)/ds = row sums
    torch.testing.assert_close(x.grad, scales.detach()[:, None].expand(5, 3))


def test_scale_bf16_input_fp32_scales():
    x = torch.randn(6, 4).to(torch.bfloat16).requires_grad_()
    scales = torch.rand(6, requires_grad=True)
    y = fo.Scale()(x, scales)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert scales.grad.dtype == torch.float32
    tol = rounding_rtol(torch.bfloat16, 4)  # a bf16 sum of 4 terms
    torch.testing.assert_close(scales.grad, x.detach().float().sum(-1), rtol=tol, atol=tol)


def test_identity_reshape():
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.equal(fo.Identity()(x), x)
    assert torch.autograd.gradcheck(fo.Identity(), (x,))
    y = fo.Reshape((-1, 4))(x)
    assert y.shape == (6, 4) and torch.equal(y, x.detach().reshape(6, 4))
    assert torch.autograd.gradcheck(fo.Reshape((3, 8)), (x,))
    with pytest.raises(ValueError, match="Reshape: cannot reshape"):
        fo.Reshape((5, -1))(x)


def test_add_extra_input_and_make_extra_output():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    other = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fo.AddExtraInput(), (x, other))
    torch.testing.assert_close(fo.AddExtraInput()(x, other), x.detach() + other.detach())
    with pytest.raises(ValueError, match="AddExtraInput"):
        fo.AddExtraInput()(x, torch.randn(3, 5))

    # the extra output is returned by the Sequential; gradients from both outputs meet
    seq = fo.Sequential(fo.ConstantScale(2.0), fo.MakeExtraOutput(), fo.ConstantScale(3.0))
    out, side = seq(x)
    torch.testing.assert_close(out, 6 * x.detach())
    torch.testing.assert_close(side, 2 * x.detach())
    x.grad = None
    (out.sum() + 10 * side.sum()).backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 6.0 + 20.0))


def test_norms_against_formulas():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    rms = fo.RMSNorm(6, eps=1e-5, dtype=torch.float64)
    ln = fo.LayerNorm(6, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-1, 1)
    xd = x.detach()
    rms_expected = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * rms.weight.detach()
    torch.testing.assert_close(rms(x), rms_expected)
    centered = xd - xd.mean(-1, keepdim=True)
    ln_expected = centered / torch.sqrt((centered**2).mean(-1, keepdim=True) + 1e-5)
    ln_expected = ln_expected * ln.weight.detach() + ln.bias.detach()
    torch.testing.assert_close(ln(x), ln_expected)

    def functional(module, names):
        return lambda x, *params: torch.func.functional_call(module, dict(zip(names, params)), (x,))

    for module, names in ((rms, ["weight"]), (ln, ["weight", "bias"])):
        params = [ref.leaf(getattr(module, n)) for n in names]
        assert torch.autograd.gradcheck(functional(module, names), (x, *params))
    # parameter grads land on the parameters when called normally
    ln(x).sum().backward()
    assert ln.weight.grad is not None and ln.bias.grad is not None


def test_basic_linear_and_bias():
    lin = fo.BasicLinear(4, 3, dtype=torch.float64)
    bias = fo.Bias(3, dtype=torch.float64)
    with torch.no_grad():
        bias.bias.uniform_(-1, 1)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(lin(x), x.detach() @ lin.weight.detach().T)
    torch.testing.assert_close(bias(lin(x)), x.detach() @ lin.weight.detach().T + bias.bias.detach())
    w, b = ref.leaf(lin.weight), ref.leaf(bias.bias)
    assert torch.autograd.gradcheck(lambda x, w: torch.func.functional_call(lin, {"weight": w}, (x,)), (x, w))
    h = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, b: torch.func.functional_call(bias, {"bias": b}, (h,)), (h, b))
    with pytest.raises(ValueError, match=r"BasicLinear: input has shape \[2, 5\]; expected \[\.\.\., 4\]"):
        lin(torch.randn(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype"):
        lin(torch.randn(2, 4))


def test_dropout():
    x = torch.randn(50, 40, requires_grad=True)
    drop = fo.Dropout(0.25)
    y = drop(x)
    kept = y != 0
    assert 0.6 < kept.float().mean().item() < 0.9  # 75% expected, 2000 samples
    torch.testing.assert_close(y[kept], x.detach()[kept] / 0.75)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.float() / 0.75)  # the same mask in backward
    drop.eval()
    assert torch.equal(drop(x), x)
    with pytest.raises(ValueError, match="Dropout"):
        fo.Dropout(1.0)


def test_unknown_kwarg_on_direct_call_is_type_error():
    with pytest.raises(TypeError, match=r"ReLU got unexpected kwarg\(s\) \['output'\]"):
        fo.ReLU()(torch.randn(2, 2), output=torch.empty(2, 2))
    with pytest.raises(TypeError, match=r"outptu"):
        fo.GroupedLinear(2, 3, 4)(torch.randn(2, 3), [1, 1], outptu=torch.empty(2, 4))


# ---------------------------------------------------------------- property test


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(list(SCALED_OPS)),
    rows=st.integers(0, 6),
    half=st.integers(1, 4),
    interleave=st.sampled_from([None, 1]),
)
def test_scaled_activation_property(kind, rows, half, interleave):
    if kind == "srelu":
        interleave = None
    op = make_activation(kind, interleave, scaled=True)
    width = 2 * half if kind != "srelu" else half
    x = 3 * torch.randn(rows, width, dtype=torch.float64)
    scales = torch.rand(rows, dtype=torch.float64)
    expected = reference_activation(kind, x, interleave) * scales[:, None]
    torch.testing.assert_close(op(x, scales), expected, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- regressions found in review


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


@pytest.mark.parametrize("value", [4.0, "4", True, None])
def test_constructor_sizes_must_be_ints(value):
    with pytest.raises(TypeError, match="GroupedLinear: num_groups must be an int"):
        fo.GroupedLinear(value, 4, 4)
    with pytest.raises(TypeError, match="BasicLinear: in_features must be an int"):
        fo.BasicLinear(value, 4)
    with pytest.raises(TypeError, match="Bias: features must be an int"):
        fo.Bias(value)


# ---------------------------------------------------------------- the activation table


def test_the_activation_table_is_what_ops_rules_and_backends_use():
    from fusible_ops.basic.activations import Activation
    from fusible_ops.basic.scaled_activations import ScaledActivation
    from fusible_ops.fused.grouped_mlp import SUPPORTED_ACTIVATIONS
    from fusible_ops.kernels.activation import ACTIVATIONS, EXPERT_BLOCK_KINDS, ActivationSpec
    from fusible_ops.kernels.cudnn.adapter import glu_unsupported_reason
    from fusible_ops.moe.layer import MOE_ACTIVATIONS

    def op_classes(base):
        found, pending = {}, [base]
        while pending:
            cls = pending.pop()
            pending.extend(cls.__subclasses__())
            if getattr(cls, "kind", ""):
                found.setdefault(cls.kind, cls)
        return found

    # every kind has an op; every expert-block kind a scaled op, used by GroupedMLP and fo.MoE
    assert set(op_classes(Activation)) == set(ACTIVATIONS)
    assert set(op_classes(ScaledActivation)) == set(EXPERT_BLOCK_KINDS)
    assert set(SUPPORTED_ACTIVATIONS) == set(MOE_ACTIVATIONS) == set(EXPERT_BLOCK_KINDS)
    for kind, row in ACTIVATIONS.items():
        spec = ActivationSpec(kind)
        assert spec.gated == row.gated
        assert op_classes(Activation)[kind]().spec.gated == row.gated
        if row.gated:  # the cuDNN adapter agrees with the table on which GLUs it fuses
            assert ("cudnn" in row.epilogue_backends) == (glu_unsupported_reason(spec) is None), kind
        if kind in MOE_ACTIVATIONS:
            assert MOE_ACTIVATIONS[kind].fc1_factor == (2 if row.gated else 1)


def test_the_plan_says_whether_the_activation_runs_fused_as_the_table_says():
    from fusible_ops.kernels.activation import ACTIVATIONS

    for cls in (fo.ScaledSwiGLU, fo.ScaledGEGLU, fo.ScaledClampedSwiGLU, fo.ScaledSReLU):
        ffn = 6 if ACTIVATIONS[cls.kind].gated else 3
        seq = fo.Sequential(fo.GroupedLinear(4, 8, ffn), cls(), fo.GroupedLinear(4, 3, 8))
        for backend in ("cpu", "torch_loop"):
            with fo.settings(backend=backend):
                (decision,) = seq.explain(
                    torch.randn(10, 8), [3, 0, 4, 3], torch.rand(10), [3, 0, 4, 3]
                ).decisions
            fused = "fused with the GEMMs" in decision.reason
            assert fused == (backend in ACTIVATIONS[cls.kind].epilogue_backends), (cls.__name__, backend)


def test_the_triton_kernels_know_every_activation_of_the_table():
    pytest.importorskip("triton")
    from fusible_ops.kernels.activation import ACTIVATIONS
    from fusible_ops.kernels.triton.kernels import _ACT_CODES

    assert set(_ACT_CODES) == {k for k, row in ACTIVATIONS.items() if "triton" in row.epilogue_backends}


def test_the_cpu_hand_fused_kinds_are_rows_of_the_table():
    from fusible_ops.kernels.activation import ACTIVATIONS, ActivationSpec
    from fusible_ops.kernels.cpu.backend import HAND_FUSED_KINDS, TorchCpuBackend

    for kind in HAND_FUSED_KINDS:
        assert "cpu" in ACTIVATIONS[kind].epilogue_backends
        assert TorchCpuBackend._is_fast_swiglu(ActivationSpec(kind))
        assert not TorchCpuBackend._is_fast_swiglu(ActivationSpec(kind, glu_interleave_size=1))
