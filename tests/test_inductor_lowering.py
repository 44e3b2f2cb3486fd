"""Inductor's decomposition of the cpu backend's grouped-MLP ops (kernels/inductor_lowering.py).

The decomposition's math is checked against an independent float64 autograd reference
(every activation kind, biases, both scale positions, both weight layouts, empty
groups, zero tokens); compiled with Inductor, bf16 runs the decomposition (no opaque
op left in the generated code) and equals eager, while fp32 and other backends keep
the opaque op.
"""

from __future__ import annotations

import pytest
import torch
from error_model import BOTH_SIDES, EXPERT_BLOCK_ROUNDINGS, expert_block_terms, rounding_rtol, tolerance
from reference_ops import activation_of, grouped_linear, max_rel_err, offsets_of

import fusible_ops as fo
from fusible_ops.kernels.activation import ActivationSpec
from fusible_ops.kernels.inductor_lowering import _traceable, mlp_backward_math, mlp_forward_math

GROUPS, HIDDEN, FFN = 4, 16, 8
# float32 vs a float64 reference (<= 11 rows a group), relative to the largest entry: the
# forward passes fc1 and fc2 (condition <= 4), the gradients the whole block (condition <= 40:
# a gradient's largest entry can be far below the magnitudes summed into it)
FORWARD_RTOL = rounding_rtol(torch.float32, HIDDEN + FFN, condition=4)
GRAD_RTOL = rounding_rtol(torch.float32, expert_block_terms(HIDDEN, FFN, 11), condition=40)
# compiled vs eager, both rounding (<= 8 rows a group)
FP32_TOL = tolerance(torch.float32, expert_block_terms(HIDDEN, FFN, 8), condition=4 * BOTH_SIDES)
BF16_TOL = tolerance(torch.bfloat16, EXPERT_BLOCK_ROUNDINGS, condition=BOTH_SIDES)
SPECS = [
    ActivationSpec("swiglu"),
    ActivationSpec("geglu"),
    ActivationSpec("clamped_swiglu"),
    ActivationSpec("srelu"),
]


def _problem(sizes, spec, bias, k_major, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    fc1_out = 2 * FFN if spec.gated else FFN

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    w1, w2 = r(GROUPS, fc1_out, HIDDEN), r(GROUPS, HIDDEN, FFN)
    if k_major:  # the [G, N, K] view of an in_out weight
        w1 = w1.transpose(-2, -1).contiguous().transpose(-2, -1)
        w2 = w2.transpose(-2, -1).contiguous().transpose(-2, -1)
    b1, b2 = (r(GROUPS, fc1_out), r(GROUPS, HIDDEN)) if bias else (None, None)
    scales = torch.rand(rows, generator=gen)
    return r(rows, HIDDEN), w1, b1, w2, b2, scales, r(rows, HIDDEN)


def _reference(x, w1, b1, w2, b2, scales, dy, sizes, spec, scale_after_fc2):
    """float64 forward and the six gradients by autograd."""
    leaves = [
        None if t is None else t.detach().double().requires_grad_() for t in (x, w1, b1, w2, b2, scales)
    ]
    x64, w1_64, b1_64, w2_64, b2_64, s64 = leaves
    pre = grouped_linear(x64, w1_64, b1_64, sizes)
    act = activation_of(spec, pre)
    if not scale_after_fc2:
        act = act * s64[:, None]
    y = grouped_linear(act, w2_64, b2_64, sizes)
    if scale_after_fc2:
        y = y * s64[:, None]
    inputs = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, inputs, dy.double(), allow_unused=True)) if y.numel() else None
    full = []
    for t in leaves:
        if t is None:
            full.append(None)
        elif grads is None:
            full.append(torch.zeros_like(t))
        else:
            g = next(grads)
            full.append(torch.zeros_like(t) if g is None else g)
    return pre.detach(), y.detach(), full


@pytest.mark.numerics
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
@pytest.mark.parametrize("scale_after_fc2", [False, True], ids=["scale_before_fc2", "scale_after_fc2"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k_major", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("sizes", [[5, 0, 11, 8], [0, 0, 0, 0]], ids=["empty_group", "zero_tokens"])
def test_decomposition_matches_float64_reference(spec, scale_after_fc2, bias, k_major, sizes):
    x, w1, b1, w2, b2, scales, dy = _problem(sizes, spec, bias, k_major, torch.float32)
    offsets = offsets_of(sizes)
    pre, y = mlp_forward_math(x, w1, b1, w2, b2, scales, offsets, spec, scale_after_fc2)
    ref_pre, ref_y, ref_grads = _reference(x, w1, b1, w2, b2, scales, dy, sizes, spec, scale_after_fc2)
    assert max_rel_err(pre, ref_pre) < FORWARD_RTOL and max_rel_err(y, ref_y) < FORWARD_RTOL
    needs = (True, True, bias, True, bias, True)
    grads = mlp_backward_math(dy, x, pre, w1, w2, b2, scales, offsets, spec, scale_after_fc2, needs)
    # gradient order of the op: input, w1, b1, w2, b2, scales
    for name, got, want in zip(("x", "w1", "b1", "w2", "b2", "scales"), grads, ref_grads):
        if want is None:
            assert got.numel() == 0, name
            continue
        assert got.shape == want.shape, name
        assert max_rel_err(got, want) < GRAD_RTOL, (name, max_rel_err(got, want))
    for index, weight in ((1, w1), (3, w2)):  # weight gradients laid out like the weights
        assert grads[index].stride() == weight.stride()


def test_decomposition_returns_empty_for_unneeded_gradients():
    spec = SPECS[0]
    sizes = [3, 1, 0, 4]
    x, w1, _, w2, _, scales, dy = _problem(sizes, spec, False, False, torch.float32)
    offsets = offsets_of(sizes)
    pre, _ = mlp_forward_math(x, w1, None, w2, None, scales, offsets, spec, False)
    needs = (False, False, False, True, False, False)  # x is not saved when w1 needs no gradient
    grads = mlp_backward_math(dy, None, pre, w1, w2, None, scales, offsets, spec, False, needs)
    assert [g.numel() == 0 for g in grads] == [True, True, True, False, True, True]


def _block(dtype):
    torch.manual_seed(0)
    return fo.Sequential(
        fo.GroupedLinear(GROUPS, HIDDEN, 2 * FFN, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(GROUPS, FFN, HIDDEN, dtype=dtype),
    )


def _compiled_code_and_results(seq, dtype, sizes):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _traceable.cache_clear()  # the dtype probe then runs inside the trace, under its modes
    gen = torch.Generator().manual_seed(1)
    rows = sum(sizes)
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(rows, generator=gen).requires_grad_()
    splits = torch.tensor(sizes)
    compiled = torch.compile(seq, backend="inductor", fullgraph=True)

    def step():
        out = compiled(x, splits, probs, splits)
        return out, torch.autograd.grad(out.float().square().sum(), [x, probs, *seq.parameters()])

    (out, grads), codes = run_and_get_code(step)
    eager = seq(x, splits, probs, splits)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), [x, probs, *seq.parameters()])
    torch._dynamo.reset()
    return "\n".join(codes), (out, grads), (eager, eager_grads)


@pytest.mark.parametrize(
    "dtype, backend, lowered",
    [(torch.bfloat16, None, True), (torch.float32, None, False), (torch.bfloat16, "torch_loop", False)],
    ids=["bf16_cpu", "fp32_cpu", "bf16_torch_loop"],
)
def test_inductor_lowers_only_what_it_can(dtype, backend, lowered):
    seq = _block(dtype)
    with fo.settings(backend=backend) if backend else fo.settings():
        code, (out, grads), (eager, eager_grads) = _compiled_code_and_results(seq, dtype, [3, 0, 5, 8])
    assert ("torch.ops.fusible_ops.grouped_mlp" not in code) == lowered, code
    assert ("_grouped_mm" in code) == lowered
    tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
    torch.testing.assert_close(out, eager, **tol)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, **tol)


def test_lowered_block_with_varying_token_counts():
    """The decomposition traces with a symbolic row count: new token counts and split sizes
    (zero-row experts included) recompile at most once, match eager, and every graph has
    the lowered GEMMs instead of the opaque op (Inductor's decomposition table, without
    Inductor's code generation, to keep the test short)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.decomposition import select_decomp_table

    from fusible_ops.kernels.inductor_lowering import register_for_tracing

    torch._dynamo.reset()
    register_for_tracing()
    targets = set()

    def compiler(gm, example_inputs):
        targets.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=select_decomp_table())
    counter = CompileCounterWithBackend(backend)
    seq = _block(torch.bfloat16)
    compiled = torch.compile(seq, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    for sizes in ([3, 0, 5, 4], [1, 2, 3, 4], [0, 0, 7, 1], [6, 2, 0, 6]):
        rows = sum(sizes)
        x = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16).requires_grad_()
        probs = torch.rand(rows, generator=gen).requires_grad_()
        splits = torch.tensor(sizes)
        results = []
        for fn in (compiled, seq):
            out = fn(x, splits, probs, splits)
            grads = torch.autograd.grad(out.float().square().sum(), [x, probs, *seq.parameters()])
            results.append((out, grads))
        (out, grads), (eager, eager_grads) = results
        torch.testing.assert_close(out, eager, **BF16_TOL)
        for got, want in zip(grads, eager_grads):
            torch.testing.assert_close(got, want, **BF16_TOL)
    assert counter.frame_count <= 2
    assert "aten._grouped_mm.default" in targets
    assert not any("fusible_ops" in t for t in targets), targets
    torch._dynamo.reset()


def test_traced_graph_carries_the_lowering_fingerprint():
    """The fused ops get the decomposition's source digest, so PyTorch's on-disk compile
    caches (keyed on the traced graph) never reuse a graph lowered by other sources."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from fusible_ops.kernels.library import LOWERING_ID

    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return make_boxed_func(gm.forward)

    # the graphs AOTAutograd hands Inductor: what its on-disk FX graph cache keys on
    # (Dynamo's graph holds one fuser_in_graph call, which AOTAutograd's cache refuses)
    seq = _block(torch.bfloat16)
    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    compiled = torch.compile(seq, backend=backend, fullgraph=True)
    sizes = [3, 0, 5, 8]
    x = torch.randn(sum(sizes), HIDDEN).to(torch.bfloat16).requires_grad_()
    probs = torch.rand(sum(sizes)).requires_grad_()
    splits = torch.tensor(sizes)
    compiled(x, splits, probs, splits).float().sum().backward()
    assert len(LOWERING_ID) == 16
    text = "\n".join(graphs)
    assert "grouped_mlp_forward" in text and "grouped_mlp_backward" in text
    assert text.count(f"lowering = '{LOWERING_ID}'") >= 2, text
    torch._dynamo.reset()
