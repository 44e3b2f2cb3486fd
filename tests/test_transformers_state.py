"""The HF integration's per-module state follows the module: what its ops are built from.

Changing ``act_fn``, GPT-OSS's ``limit``/``alpha`` or an instance ``_apply_gate`` after
the first call gives transformers' own result for the new setting; ``functional_call``
and ``parametrize`` work as with transformers' implementations; dtypes transformers'
``grouped_mm`` cannot run fall back to its eager forward, with one warning.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch.func import functional_call
from torch.nn.utils import parametrize

transformers = pytest.importorskip("transformers")
fot = pytest.importorskip("fusible_ops.integrations.transformers")

from hf_tiny_models import experts_modules, tiny_model  # noqa: E402

HIDDEN = 32


def _experts(family: str, dtype: torch.dtype = torch.float64):
    """One experts module of a tiny ``family`` model, its config on fusible_ops, and inputs."""
    model = tiny_model(family, dtype, hidden=HIDDEN, layers=1, experts=4)
    model.set_experts_implementation("fusible_ops")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, HIDDEN, dtype=dtype, generator=gen)
    top_k = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, dtype=dtype, generator=gen)
    return model, experts_modules(model)[0], (x, top_k, weights)


def _with(model, implementation: str, fn):
    """``fn()`` with every experts module of ``model`` on ``implementation``; back to fusible_ops."""
    model.set_experts_implementation(implementation)
    try:
        return fn()
    finally:
        model.set_experts_implementation("fusible_ops")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


#: float64, a handful of terms per dot product: differences of summation order only
TOL64 = 1e-12


def test_act_fn_replaced_after_the_first_call_is_honoured():
    model, e, args = _experts("mixtral")
    e(*args)
    e.act_fn = transformers.activations.NewGELUActivation()  # fused as GEGLU
    got = e(*args)
    assert type(fot.cached_ops(e)[1]).__name__ == "ScaledGEGLU"
    assert _rel(got, _with(model, "eager", lambda: e(*args))) < TOL64
    e.act_fn = torch.nn.Tanh()  # nothing fuses it: transformers' eager forward (float64)
    with pytest.warns(UserWarning, match="MixtralExperts runs on transformers' eager .*act_fn Tanh"):
        got = e(*args)
    assert torch.equal(got, _with(model, "eager", lambda: e(*args)))


@pytest.mark.parametrize("attribute, value", [("limit", 0.3), ("alpha", 0.5)])
def test_gpt_oss_limit_and_alpha_changed_after_the_first_call_are_honoured(attribute, value):
    model, e, args = _experts("gpt_oss")
    before = e(*args)
    setattr(e, attribute, value)
    got = e(*args)
    expected = _with(model, "eager", lambda: e(*args))
    assert _rel(got, expected) < TOL64 and _rel(before, expected) > 1e-3  # it mattered
    assert getattr(fot.cached_ops(e)[1].spec, attribute) == value


def test_apply_gate_set_on_the_instance_after_the_first_call_is_honoured():
    model, e, args = _experts("gpt_oss")
    e(*args)

    def halved_gate(gate_up):  # GPT-OSS's eager forward calls self._apply_gate
        return type(e)._apply_gate(e, gate_up) / 2

    e._apply_gate = halved_gate
    with pytest.warns(UserWarning, match="GptOssExperts runs on .* unknown _apply_gate override"):
        got = e(*args)
    assert _rel(got, _with(model, "eager", lambda: e(*args))) < TOL64
    assert fot.cached_ops(e) is None
    # the class's own gate bound to this module is still fused
    e._apply_gate = types.MethodType(type(e)._apply_gate, e)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = e(*args)
    assert fot.cached_ops(e) is not None
    assert _rel(got, _with(model, "eager", lambda: e(*args))) < TOL64


def test_float64_fallback_runs_transformers_eager_forward_with_one_warning():
    model, e, args = _experts("mixtral")
    e.act_fn = torch.nn.GELU()  # exact erf: no fused kernel computes it
    fot._WARNED.clear()
    with pytest.warns(UserWarning, match="MixtralExperts runs on transformers' eager experts implementation"):
        got = e(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class and implementation
        e(*args)
    assert torch.equal(got, _with(model, "eager", lambda: e(*args)))
    # float32 falls back to grouped_mm, as before
    model.float()
    args32 = [a.float() if a.is_floating_point() else a for a in args]
    with pytest.warns(UserWarning, match="runs on transformers' grouped_mm experts implementation"):
        got = e(*args32)
    expected = _with(model, "grouped_mm", lambda: e(*args32))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _grads(output: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return torch.autograd.grad(output.square().sum(), tensors)


@pytest.mark.parametrize(
    "family, dtype, reference",
    [
        ("mixtral", torch.float64, "eager"),
        ("gpt_oss", torch.float64, "eager"),
        ("mixtral", torch.float32, "grouped_mm"),
    ],
)
def test_functional_call_works_as_with_transformers_implementations(family, dtype, reference):
    model, e, args = _experts(family, dtype)
    before = e(*args).detach()
    params = {n: (p.detach() * 1.5).requires_grad_() for n, p in e.named_parameters()}
    got = functional_call(e, params, args)
    grads = _grads(got, list(params.values()))
    expected = _with(model, reference, lambda: functional_call(e, params, args))
    expected_grads = _grads(expected, list(params.values()))
    # float32: grouped_mm and fusible-ops sum in different orders, ~1e-6 relative
    tol = TOL64 if dtype == torch.float64 else 1e-5
    assert _rel(got, expected) < tol
    for name, g, eg in zip(params, grads, expected_grads):
        assert _rel(g, eg) < tol, name
    assert torch.equal(e(*args), before)  # the module's own parameters again
    assert fot.cached_ops(e)[0].weight is e.gate_up_proj


class _Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.5


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_parametrized_projections_work_as_with_transformers_eager(family):
    model, e, args = _experts(family)
    e(*args)
    parametrize.register_parametrization(e, "down_proj", _Scaled())
    original = e.parametrizations.down_proj.original
    got = e(*args)
    (grad,) = _grads(got, [original])
    expected = _with(model, "eager", lambda: e(*args))
    (expected_grad,) = _grads(expected, [original])
    assert _rel(got, expected) < TOL64 and _rel(grad, expected_grad) < TOL64
    with parametrize.cached():
        assert _rel(e(*args), expected) < TOL64
    parametrize.remove_parametrizations(e, "down_proj")
    e(*args)
    assert fot.cached_ops(e)[2].weight is e.down_proj
