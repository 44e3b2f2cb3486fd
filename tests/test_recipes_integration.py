"""Recipes with the rest of the library: the context and module recipes, caller buffers,
torch.compile, the quantized-weight cache, the scaled_mm engine, the plan, errors."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fusible_ops as fo
from fusible_ops.recipes import weight_cache

R = fo.recipes
GROUPS = [5, 0, 27, 16]
M = sum(GROUPS)


def block(scale_after: bool = False) -> fo.Sequential:
    ops = [
        fo.GroupedLinear(4, 64, 96, bias=True),
        fo.SwiGLU() if scale_after else fo.ScaledSwiGLU(),
        fo.GroupedLinear(4, 48, 64, bias=True),
    ]
    return fo.Sequential(*ops, *([fo.Scale()] if scale_after else []))


def inputs():
    x = torch.randn(M, 64, requires_grad=True)
    probs = torch.rand(M, requires_grad=True)
    return x, probs, torch.tensor(GROUPS)


def run(seq, x, probs, splits, op_kwargs=None, dy=None):
    ops = getattr(seq, "_orig_mod", seq)  # a compiled module's own
    args = (x, splits, splits, probs) if len(ops) == 4 else (x, splits, probs, splits)
    y = seq(*args, op_kwargs=op_kwargs)
    y.backward(torch.ones_like(y) if dy is None else dy)
    grads = [x.grad.clone(), probs.grad.clone(), ops[0].weight.grad.clone(), ops[2].weight.grad.clone()]
    for t in (x, probs, ops[0].weight, ops[2].weight, ops[0].bias, ops[2].bias):
        t.grad = None
    return y.detach().clone(), grads


# ---------------------------------------------------------------- context and module recipes


def test_context_is_thread_local_and_nests():
    import threading

    seen = []
    with fo.quantized(R.MXFP8()):
        with fo.quantized(R.Float8Rowwise()):
            assert fo.current_settings().recipe == R.Float8Rowwise()
        assert fo.current_settings().recipe == R.MXFP8()
        thread = threading.Thread(target=lambda: seen.append(fo.current_settings().recipe))
        thread.start()
        thread.join()
    assert seen == [None] and fo.current_settings().recipe is None


def test_module_recipe_wins_over_the_context():
    seq = block()
    x, probs, splits = inputs()
    with fo.quantized(R.Float8Rowwise()):
        expected, _ = run(seq, x, probs, splits)
    seq.recipe = R.Float8Rowwise()
    with fo.quantized(R.MXFP8()):
        got, _ = run(seq, x, probs, splits)
        assert "Float8Rowwise" in str(seq.last_plan) and "MXFP8" not in str(seq.last_plan)
    assert torch.equal(got, expected)
    outside, _ = run(seq, x, probs, splits)  # the module's recipe applies without a context too
    assert torch.equal(outside, expected)
    assert "recipe=Float8Rowwise" in repr(seq)


def test_moe_recipe_reaches_its_experts():
    moe = fo.MoE(32, 16, 4, 2, recipe=R.MXFP8())
    assert moe.experts.recipe == R.MXFP8()
    moe(torch.randn(6, 32)).sum().backward()
    assert "MXFP8" in str(moe.experts.last_plan)


def test_bad_recipes_are_refused():
    with pytest.raises(TypeError, match="recipe"):
        with fo.quantized("mxfp8"):
            pass
    with pytest.raises(TypeError, match="Sequential: recipe"):
        fo.Sequential(fo.BasicLinear(4, 4), recipe="mxfp8")
    with pytest.raises(ValueError, match="recipe_backend"):
        with fo.quantized(R.MXFP8(), backend="fast"):
            pass


# ---------------------------------------------------------------- caller buffers


@pytest.mark.parametrize("recipe", [R.MXFP8(), R.Float8Tensorwise(), R.Float8Rowwise()], ids=repr)
def test_buffers_bit_exact_tail_untouched(recipe):
    seq = block()
    x, probs, splits = inputs()
    dy = torch.randn(M, 64)
    with fo.quantized(recipe):
        y, grads = run(seq, x, probs, splits, dy=dy)
        out = torch.full((M + 3, 64), 7.0)
        grad_in = torch.full((M + 2, 64), -3.0)
        kwargs = {2: {fo.OUTPUT_BUFFER_KEY: out}, 0: {fo.GRAD_INPUT_BUFFER_KEY: grad_in}}
        y_buf = seq(x, splits, probs, splits, op_kwargs=kwargs)
        assert y_buf.data_ptr() == out.data_ptr()
        y_buf.backward(dy)
    assert "GroupedMLP" in seq.last_plan.fusion_plans[0].forward_op_types()
    assert torch.equal(out[:M], y) and torch.equal(grad_in[:M], grads[0])
    assert (out[M:] == 7.0).all() and (grad_in[M:] == -3.0).all()


def test_bad_buffer_is_refused_before_any_write():
    seq = block()
    x, probs, splits = inputs()
    weights = [p.detach().clone() for p in seq.parameters()]
    out = torch.full((M, 64), 7.0, dtype=torch.bfloat16)
    with fo.quantized(R.MXFP8()), pytest.raises(ValueError, match="dtype"):
        seq(x, splits, probs, splits, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: out}})
    assert (out == 7.0).all()
    assert all(torch.equal(a, b) for a, b in zip(weights, seq.parameters()))


# ---------------------------------------------------------------- torch.compile


def test_compile_fullgraph_equals_eager_and_recompiles_only_on_a_new_recipe():
    seq = block()
    x, probs, splits = inputs()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(seq, backend=counter, fullgraph=True)
    for recipe, compilations in ((R.MXFP8(), 1), (R.MXFP8(), 1), (R.Float8Rowwise(), 2), (R.MXFP8(), 2)):
        with fo.quantized(recipe):
            eager = run(seq, x, probs, splits)
            got = run(compiled, x, probs, splits)
        assert torch.equal(got[0], eager[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], eager[1]))
        assert counter.frame_count == compilations


def test_compile_module_recipe_under_fullgraph():
    seq = block(scale_after=True)
    seq.recipe = R.Float8Blockwise()
    x, probs, splits = inputs()
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    eager = run(seq, x, probs, splits)
    got = run(compiled, x, probs, splits)
    assert torch.equal(got[0], eager[0]) and all(torch.equal(a, b) for a, b in zip(got[1], eager[1]))


def test_quantizer_under_inductor():
    """Inductor compiles the quantizer to the same bits (odd widths: a partial column tile)."""
    x = torch.randn(9, 48)
    fn = lambda t: R.quantize_rows(t, R.MXFP8(), "input", "columns", None).dequantize()  # noqa: E731
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


# ---------------------------------------------------------------- the weight cache


def _forward(seq, x):
    with fo.quantized(R.MXFP8()):
        return seq(x, [3, 5]).detach().clone()


def _fresh(seq, x):
    weight_cache.clear_weight_cache()
    return _forward(seq, x)


@pytest.mark.parametrize("change", ["optimizer", "load_state_dict", "swap", "data"])
def test_stale_weight_copy_is_never_used(change):
    seq = fo.Sequential(fo.GroupedLinear(2, 64, 32))
    x = torch.randn(8, 64)
    weight_cache.clear_weight_cache()
    first = _forward(seq, x)
    assert torch.equal(_forward(seq, x), first) and weight_cache.STATS["hits"] == 1  # reused
    fc = seq[0]
    if change == "optimizer":
        fc.weight.grad = torch.randn_like(fc.weight)
        torch.optim.SGD(seq.parameters(), lr=0.5).step()
    elif change == "load_state_dict":
        seq.load_state_dict({"0.weight": torch.randn_like(fc.weight)})
    elif change == "swap":
        fc.weight = torch.nn.Parameter(torch.randn_like(fc.weight))
    else:
        fc.weight.data = torch.randn_like(fc.weight)
    after = _forward(seq, x)
    assert not torch.equal(after, first)
    assert torch.equal(after, _fresh(seq, x))


# ---------------------------------------------------------------- engines and the plan


@pytest.mark.parametrize("recipe", [R.Float8Tensorwise(), R.Float8Rowwise()], ids=repr)
def test_scaled_mm_engine_agrees_with_emulation(recipe):
    seq = block()
    lin = fo.Sequential(fo.BasicLinear(64, 24))
    x, probs, splits = inputs()
    with fo.quantized(recipe):
        emulated = run(seq, x, probs, splits)
        xl = x.detach().requires_grad_()
        lin(xl).sum().backward()
        emulated_dense = (lin(x).detach(), xl.grad.clone(), lin[0].weight.grad.clone())
    lin[0].weight.grad = None
    with fo.quantized(recipe, backend="scaled_mm"):
        real = run(seq, x, probs, splits)
        assert "engine scaled_mm" in str(seq.last_plan)
        xl = x.detach().requires_grad_()
        lin(xl).sum().backward()
        real_dense = (lin(x).detach(), xl.grad.clone(), lin[0].weight.grad.clone())
    for a, b in zip([real[0], *real[1], *real_dense], [emulated[0], *emulated[1], *emulated_dense]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_forced_engines_that_cannot_run_raise():
    seq = fo.Sequential(fo.GroupedLinear(2, 32, 32))
    with (
        fo.quantized(R.MXFP8(), backend="scaled_mm"),
        pytest.raises(RuntimeError, match="tensorwise and rowwise"),
    ):
        seq(torch.randn(4, 32), [2, 2])
    with (
        fo.quantized(R.Float8Rowwise(), backend="scaled_grouped_mm"),
        pytest.raises(RuntimeError, match="CUDA"),
    ):
        seq(torch.randn(4, 32), [2, 2])


def test_float64_is_refused_with_the_op_name():
    seq = fo.Sequential(fo.GroupedLinear(2, 32, 32, dtype=torch.float64))
    with fo.quantized(R.MXFP8()), pytest.raises(ValueError, match="GroupedLinear.*float64"):
        seq(torch.randn(4, 32, dtype=torch.float64), [2, 2])


def test_plan_names_recipe_gemms_and_engines():
    seq = fo.Sequential(fo.BasicLinear(32, 32), fo.Bias(32), fo.ReLU())
    with fo.quantized(R.Float8Rowwise(wgrad_high_precision=True)):
        text = str(seq.explain(torch.randn(4, 32)))
    assert "recipe Float8Rowwise" in text and "fprop, dgrad quantized, wgrad high precision" in text
    assert "scaled_grouped_mm: needs a CUDA device" in text
    assert "the quantized linear runs unfused" in text  # the dense forward fusion declines


def test_saves_fewer_bytes_than_unquantized():
    seq = block()
    x, probs, splits = inputs()

    def saved_bytes():
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            seq(x, splits, probs, splits)
        return sum(sizes)

    plain = saved_bytes()
    with fo.quantized(R.MXFP8()):
        quantized = saved_bytes()
    assert quantized < plain
