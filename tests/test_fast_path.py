"""The fuser's fast path: a signature's later calls run its bound op behind guards.

Every case compares the fast call with the same call taken by the general path (a deep
copy's first call: same values, no fast path yet), bit for bit, and with the float64
reference; every guard is changed after the fast path is in place and must send the
call back to the general path with the right result.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import reference_ops as ref
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusible_ops as fo
import fusible_ops.core.settings as settings_module
import fusible_ops.fuser.operation_fuser as operation_fuser
from fusible_ops.fuser.fast_path import MAX_REBUILDS

SPLITS = [5, 0, 7, 4]
ROWS, HIDDEN, FFN, EXPERTS = 16, 32, 16, 4


def make_block(dtype=torch.float32, *, bias=False, scale_after=False, kind="swiglu", layout="out_in"):
    torch.manual_seed(0)
    act = {"swiglu": (fo.SwiGLU, fo.ScaledSwiGLU), "geglu": (fo.GEGLU, fo.ScaledGEGLU)}[kind]
    fc1 = fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, bias=bias, dtype=dtype, weight_layout=layout)
    fc2 = fo.GroupedLinear(EXPERTS, FFN, HIDDEN, bias=bias, dtype=dtype, weight_layout=layout)
    if bias:
        with torch.no_grad():
            fc1.bias.normal_()
            fc2.bias.normal_()
    if scale_after:
        return fo.Sequential(fc1, act[0](), fc2, fo.Scale())
    return fo.Sequential(fc1, act[1](), fc2)


def extras(block, splits, probs):
    return (splits, splits, probs) if len(block) == 4 else (splits, probs, splits)


def fuser_of(block):
    return block._get_groups()[0][1]


def fast_of(block, grad: bool = True):
    """The block's fast call for its inputs' shape under this grad mode, or None."""
    calls = [fast for (_, grad_enabled), fast in fuser_of(block)._fast_index.items() if grad_enabled == grad]
    return calls[-1] if calls else None


@pytest.fixture
def signatures(monkeypatch):
    """How often a call computed its signature (the fast path does not)."""
    calls = []
    original = operation_fuser.call_signature

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(operation_fuser, "call_signature", counted)
    return calls


def inputs(dtype, rows=ROWS, *, grad=True, shape=None):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*(shape or (rows, HIDDEN)), generator=gen).to(dtype).requires_grad_(grad)
    probs = torch.rand(rows, generator=gen).requires_grad_(grad)
    grad_y = torch.randn(*(shape or (rows, HIDDEN))[:-1], HIDDEN, generator=gen).to(dtype)
    return x, probs, grad_y


def run(block, x, probs, splits, grad_y):
    """Output and the gradients of x, probs and every parameter (None where not needed)."""
    y = block(x, *extras(block, splits, probs))
    leaves = [t for t in (x, probs, *block.parameters()) if t.requires_grad]
    if not y.requires_grad:
        return y, []
    return y, list(torch.autograd.grad(y, leaves, grad_y))


def warm(block, x, probs, splits, grad_y, signatures):
    """Calls until the fast path is in place; the next call must not compute a signature."""
    for _ in range(3):
        run(block, x, probs, splits, grad_y)
    assert fast_of(block, torch.is_grad_enabled()) is not None, fuser_of(block)._fast_calls._entries
    before = len(signatures)
    result = run(block, x, probs, splits, grad_y)
    assert len(signatures) == before, "the call did not take the fast path"
    return result


def assert_same(got, want):
    (y, grads), (y_ref, grads_ref) = got, want
    assert torch.equal(y, y_ref)
    assert len(grads) == len(grads_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert torch.equal(g, g_ref)


CASES = {
    "fp32 (one _grouped_mm per GEMM)": dict(dtype=torch.float32),
    "bf16": dict(dtype=torch.bfloat16),
    "fp64 (per-group hooks)": dict(dtype=torch.float64),
    "biases, scale after fc2": dict(dtype=torch.float32, bias=True, scale_after=True),
    "GEGLU (composed activation)": dict(dtype=torch.float32, kind="geglu"),
    "in_out weights": dict(dtype=torch.float32, layout="in_out"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["fwd+bwd", "no_grad", "frozen weights", "input only"])
def test_fast_call_equals_the_general_path(case, mode, signatures):
    options = CASES[case]
    dtype = options["dtype"]
    block = make_block(**options)
    general = copy.deepcopy(block)  # its first call takes the general path
    x, probs, grad_y = inputs(dtype, grad=mode not in ("no_grad", "frozen weights"))
    if mode in ("frozen weights", "input only"):
        for module in (block, general):
            module.requires_grad_(False)
    splits = torch.tensor(SPLITS)
    context = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    with context:
        got = warm(block, x, probs, splits, grad_y, signatures)
        want = run(general, x, probs, splits, grad_y)
    assert_same(got, want)
    assert str(block.last_plan) == str(general.last_plan)
    # and both against the float64 reference
    bias = options.get("bias", False)
    params = {n: p.detach().double().requires_grad_(p.requires_grad) for n, p in block.named_parameters()}
    x64, probs64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (x, probs))
    act = options.get("kind", "swiglu")
    w1, w2 = params["0.weight"], params["2.weight"]
    if options.get("layout") == "in_out":
        w1, w2 = w1.transpose(-2, -1), w2.transpose(-2, -1)
    with torch.enable_grad():
        if options.get("scale_after"):
            hidden = ref.grouped_linear(x64, w1, params.get("0.bias"), SPLITS)
            expected = ref.grouped_linear(ref.activation(act, hidden), w2, params.get("2.bias"), SPLITS)
            expected = expected * probs64.unsqueeze(-1)
        else:
            expected = ref.expert_block(
                x64, w1, probs64, w2, SPLITS, kind=act,
                fc1_bias=params.get("0.bias") if bias else None, fc2_bias=params.get("2.bias") if bias else None,
            )  # fmt: skip
    # error model: the reduction lengths here are at most 2 * FFN = 32 terms
    tols = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 6e-2}
    tol = tols[dtype]
    torch.testing.assert_close(got[0].double(), expected.detach(), rtol=tol, atol=tol)
    leaves = [t for t in (x64, probs64, *params.values()) if t.requires_grad]
    if leaves:  # every gradient, the empty group's weight gradients (exact zeros) included
        want_grads = torch.autograd.grad(expected, leaves, grad_y.double())
        for g, w in zip(got[1], want_grads):
            tol = max(tols[g.dtype], tols[dtype])  # the probs are float32 whatever the block's dtype
            torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * max(1.0, w.abs().max().item()))


def test_three_dimensional_input_and_an_empty_group(signatures):
    block = make_block()
    general = copy.deepcopy(block)
    x, probs, grad_y = inputs(torch.float32, shape=(4, 4, HIDDEN))
    splits = torch.tensor([0, 8, 8, 0])
    assert_same(warm(block, x, probs, splits, grad_y, signatures), run(general, x, probs, splits, grad_y))


def warmed(dtype=torch.float32, grad=True, **options):
    """A block whose next call of these inputs takes the fast path (``grad``: the inputs need
    a gradient)."""
    block = make_block(dtype, **options)
    x, probs, grad_y = inputs(dtype, grad=grad)
    splits = torch.tensor(SPLITS)
    for _ in range(3):
        run(block, x, probs, splits, grad_y)
    assert fast_of(block) is not None
    return block, x, probs, splits, grad_y


def reference_run(block, x, probs, splits, grad_y):
    """The general path's answer for the block's current parameters and these inputs."""
    return run(copy.deepcopy(block), x, probs, splits, grad_y)


def test_a_new_shape_and_new_split_values(signatures):
    block, *_ = warmed()
    x, probs, grad_y = inputs(torch.float32, rows=9)
    splits = torch.tensor([1, 2, 3, 3])
    assert_same(run(block, x, probs, splits, grad_y), reference_run(block, x, probs, splits, grad_y))


def test_split_values_written_in_place_are_read_and_checked(signatures):
    block, x, probs, splits, grad_y = warmed()
    splits.copy_(torch.tensor([0, 16, 0, 0]))
    assert_same(run(block, x, probs, splits, grad_y), reference_run(block, x, probs, splits, grad_y))
    splits.copy_(torch.tensor([4, 4, 4, 5]))
    weights = [p.detach().clone() for p in block.parameters()]
    with pytest.raises(ValueError) as general:
        reference_run(block, x, probs, splits, grad_y)
    before = len(signatures)
    with pytest.raises(ValueError, match="sum to 17 but the input has 16 rows") as fast:
        run(block, x, probs, splits, grad_y)
    assert len(signatures) == before, "the refusal came from the fast path"
    assert str(fast.value) == str(general.value)
    for p, w in zip(block.parameters(), weights):
        assert torch.equal(p, w) and p.grad is None
    splits.copy_(torch.tensor([-1, 9, 4, 4]))
    with pytest.raises(ValueError, match="must be non-negative"):
        run(block, x, probs, splits, grad_y)


def test_a_frozen_parameter(signatures):
    block, x, probs, splits, grad_y = warmed()
    block[2].weight.requires_grad_(False)
    y = block(x, *extras(block, splits, probs))
    y.backward(grad_y)
    assert block[2].weight.grad is None and block[0].weight.grad is not None


def test_a_replaced_parameter(signatures):
    block, x, probs, splits, grad_y = warmed()
    block[0].weight = torch.nn.Parameter(torch.randn_like(block[0].weight))
    before = len(signatures)
    assert_same(run(block, x, probs, splits, grad_y), reference_run(block, x, probs, splits, grad_y))
    assert len(signatures) > before + 1, "the replaced parameter took the fast path"


def test_unfrozen_after_forward_and_changed_in_place_before_backward():
    block, x, probs, splits, grad_y = warmed()
    block[2].weight.requires_grad_(False)
    for _ in range(3):
        run(block, x, probs, splits, grad_y)  # a fast call for the frozen signature
    y = block(x, *extras(block, splits, probs))
    block[2].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="'weight' was set to require grad after forward"):
        y.backward(grad_y)
    y = block(x, *extras(block, splits, probs))
    with torch.no_grad():
        block[0].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(grad_y)


def test_a_late_hook_runs(signatures):
    block, x, probs, splits, grad_y = warmed()
    seen = []
    block[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    run(block, x, probs, splits, grad_y)
    assert seen == [torch.Size([ROWS, FFN])]
    assert "forward hook on op 1" in str(block.last_plan)


def _eval(block):
    block.eval()
    return contextlib.nullcontext()


CHANGES = {
    "settings": lambda block: fo.settings(fusion=False),
    "training flag": _eval,
    "autocast": lambda block: torch.autocast("cpu", dtype=torch.bfloat16),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_the_plan_depends_on_leaves_the_fast_path(change, signatures):
    block, x, probs, splits, grad_y = warmed()
    with CHANGES[change](block):
        want = reference_run(block, x, probs, splits, grad_y)
        before = len(signatures)
        got = run(block, x, probs, splits, grad_y)
        assert len(signatures) > before, "the call took the fast path"
        assert_same(got, want)
        assert str(block.last_plan) == str(want_plan(block, x, probs, splits))


def want_plan(block, x, probs, splits):
    return copy.deepcopy(block).explain(x, *extras(block, splits, probs))


@pytest.mark.parametrize("grad", [True, False])
def test_inference_mode_leaves_the_fast_path(grad, signatures):
    block, x, probs, splits, grad_y = warmed(grad=grad)
    before = len(signatures)
    with torch.inference_mode():
        y = block(x.detach(), *extras(block, splits, probs.detach()))
    assert len(signatures) > before
    assert torch.equal(y, reference_run(block, x, probs, splits, grad_y)[0])


class Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_library_ops(signatures):
    block, x, probs, splits, grad_y = warmed(grad=False)
    with Recording() as mode:
        y = block(x, *extras(block, splits, probs))
    assert any("fusible_ops.grouped_mlp_forward" in op for op in mode.ops)
    assert torch.equal(y, block(x, *extras(block, splits, probs)))


def test_split_objects_and_strides_that_differ_from_the_bound_call(signatures):
    block, x, probs, splits, grad_y = warmed()
    other = splits.clone()  # equal values, another object: compared by value, still fused
    y = block(x, splits, probs, other)
    assert torch.equal(y, reference_run(block, x, probs, splits, grad_y)[0])
    assert "GroupedMLP" in str(block.last_plan)
    strided = torch.randn(HIDDEN, ROWS).t().requires_grad_(True)  # the same shape, other strides
    assert_same(
        run(block, strided, probs, splits, grad_y), reference_run(block, strided, probs, splits, grad_y)
    )


def test_functional_call_with_new_tensors_on_every_call():
    block, x, probs, splits, grad_y = warmed()
    for step in range(MAX_REBUILDS + 3):
        new_w2 = torch.randn_like(block[2].weight, requires_grad=True)
        y = torch.func.functional_call(block, {"2.weight": new_w2}, (x, splits, probs, splits))
        expected = ref.expert_block(x, block[0].weight, probs, new_w2, SPLITS)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        (got,) = torch.autograd.grad(y, [new_w2], grad_y)
        (want,) = torch.autograd.grad(expected, [new_w2], grad_y)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    reasons = [v for v in fuser_of(block)._fast_calls._entries.values() if isinstance(v, str)]
    assert reasons and "kept failing" in reasons[0]


def test_a_deep_copy_computes_with_its_own_parameters():
    block, x, probs, splits, grad_y = warmed()
    twin = copy.deepcopy(block)
    with torch.no_grad():
        twin[0].weight.mul_(2)
    for _ in range(4):
        got = run(twin, x, probs, splits, grad_y)
    assert not torch.equal(got[0], run(block, x, probs, splits, grad_y)[0])
    assert_same(got, reference_run(twin, x, probs, splits, grad_y))


@pytest.mark.parametrize("mode", ["fwd+bwd", "no_grad"])
def test_split_lists(mode, signatures):
    """One list given to fc1 and fc2 takes the fast call, its values read and checked on
    every call; two distinct (equal) lists take the general path, which compares them."""
    block = make_block()
    general = copy.deepcopy(block)
    x, probs, grad_y = inputs(torch.float32, grad=mode == "fwd+bwd")
    splits = list(SPLITS)
    context = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
    with context:
        assert_same(warm(block, x, probs, splits, grad_y, signatures), run(general, x, probs, splits, grad_y))
        splits[:] = [0, 16, 0, 0]  # the same list, written in place
        assert_same(run(block, x, probs, splits, grad_y), reference_run(block, x, probs, splits, grad_y))
        for bad, message in (([4, 4, 4, 5], "sum to 17"), ([-1, 9, 4, 4], "non-negative"), ([8, 8, 0, True], "ints")):
            splits[:] = bad
            before = len(signatures)
            with pytest.raises(ValueError, match=message):
                run(block, x, probs, splits, grad_y)
            assert len(signatures) == before, "the refusal came from the fast path"
        as_floats = torch.tensor([4.0, 4.0, 4.0, 4.0])  # a tensor where the list was
        with pytest.raises(ValueError, match="must be an integer tensor"):
            block(x, as_floats, probs, as_floats)
        splits[:] = [8, 8]  # another length: the general path refuses it
        with pytest.raises(ValueError, match="length 2"):
            run(block, x, probs, splits, grad_y)
        fc1_splits, fc2_splits = list(SPLITS), list(SPLITS)
        for _ in range(4):
            y = block(x, fc1_splits, probs, fc2_splits)
        reasons = [v for v in fuser_of(block)._fast_calls._entries.values() if isinstance(v, str)]
        assert reasons == ["distinct split-size tensors, whose values the plan compares"]
        torch.testing.assert_close(y, ref.expert_block(x, block[0].weight, probs, block[2].weight, SPLITS))


@pytest.fixture
def recipe_context_used():
    used = settings_module.RECIPE_CONTEXT_USED
    before = used[0]
    used[0] = True
    yield
    used[0] = before


def test_a_process_that_used_a_recipe_context_still_records_each_forward(recipe_context_used, signatures):
    """Once a recipe was set through a context, differentiable forwards record their context
    recipe (for activation-checkpointing recomputation); fast calls do too."""
    block = make_block()
    general = copy.deepcopy(block)
    x, probs, grad_y = inputs(torch.float32)
    splits = torch.tensor(SPLITS)
    assert_same(warm(block, x, probs, splits, grad_y, signatures), run(general, x, probs, splits, grad_y))
    y = block(x, *extras(block, splits, probs))
    assert fuser_of(block)._live_forward_recipes == {None: 1}
    del y
    assert fuser_of(block)._live_forward_recipes == {None: 0}


def test_equal_split_tensors_given_as_two_objects_take_the_general_path(signatures):
    """The plan of distinct split-size tensors depends on whether their values are equal:
    after calls with equal values, a call with different ones must not reuse it."""
    block = make_block()
    x, probs, grad_y = inputs(torch.float32)
    fc1_splits, fc2_splits = torch.tensor(SPLITS), torch.tensor(SPLITS)
    for _ in range(4):
        y = block(x, fc1_splits, probs, fc2_splits)
    assert "GroupedMLP" in str(block.last_plan) and not fuser_of(block)._fast_index
    fc2_splits.copy_(torch.tensor([4, 4, 4, 4]))
    y = block(x, fc1_splits, probs, fc2_splits)
    assert "GroupedMLP" not in str(block.last_plan)
    hidden = ref.grouped_linear(x.detach().double(), block[0].weight.detach().double(), None, SPLITS)
    act = ref.activation("swiglu", hidden) * probs.detach().double().unsqueeze(-1)
    expected = ref.grouped_linear(act, block[2].weight.detach().double(), None, [4, 4, 4, 4])
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4)


def test_grad_mode_leaves_the_fast_path(signatures):
    """A block warmed under no_grad, with parameters that require grad: a call with grad
    enabled must build the library's autograd node (and the other way round)."""
    block = make_block()
    x, probs, grad_y = inputs(torch.float32, grad=False)
    splits = torch.tensor(SPLITS)
    with torch.no_grad():
        for _ in range(3):
            block(x, *extras(block, splits, probs))
    assert fast_of(block, grad=False) is not None and fast_of(block, grad=True) is None
    y = block(x, *extras(block, splits, probs))
    # the library's autograd node, not autograd recording the kernels' torch ops one by one
    assert type(y.grad_fn).__name__ in ("FuserFunctionBackward", "FastFunctionBackward")
    assert_same(run(block, x, probs, splits, grad_y), reference_run(block, x, probs, splits, grad_y))
    for _ in range(3):
        run(block, x, probs, splits, grad_y)
    assert fast_of(block, grad=True).requires_grad
    with torch.no_grad():
        assert block(x, *extras(block, splits, probs)).grad_fn is None


def test_alternating_shapes_and_settings_each_keep_their_fast_call(signatures):
    """Token counts that change from call to call, and an unfused call in between, do not
    send the next call of a known signature to the general path."""
    block = make_block()
    calls = []
    for rows, sizes in ((16, SPLITS), (9, [1, 2, 3, 3])):
        x, probs, grad_y = inputs(torch.float32, rows=rows)
        calls.append((x, probs, torch.tensor(sizes), grad_y))
    for _ in range(3):
        for x, probs, splits, grad_y in calls:
            run(block, x, probs, splits, grad_y)
    before = len(signatures)
    for _ in range(2):
        for x, probs, splits, grad_y in calls:
            assert_same(run(block, x, probs, splits, grad_y), reference_run(block, x, probs, splits, grad_y))
            with fo.settings(fusion=False):
                run(block, x, probs, splits, grad_y)
    # the general path ran only for the deep copies' first calls and the unfused calls
    assert len(signatures) - before == 2 * len(calls) * 2


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_across_the_first_fast_call(use_reentrant):
    """The forward of one step takes the general path and its recomputation the fast call
    (or the other way round): the gradients are those of the plain calls."""
    block = make_block()
    plain = copy.deepcopy(block)
    x, probs, grad_y = inputs(torch.float32)
    splits = torch.tensor(SPLITS)
    for step in range(4):
        leaves = [t.detach().requires_grad_(True) for t in (x, probs)]
        block.zero_grad(set_to_none=True)
        y = torch.utils.checkpoint.checkpoint(
            block, leaves[0], *extras(block, splits, leaves[1]), use_reentrant=use_reentrant
        )
        y.backward(grad_y)
        got = [leaves[0].grad, leaves[1].grad, *(p.grad for p in block.parameters())]
        want = run(plain, x, probs, splits, grad_y)
        assert torch.equal(y, want[0]), step
        for g, w in zip(got, want[1]):
            assert torch.equal(g, w), step


def test_fast_calls_keep_no_module_or_replaced_parameter_alive():
    """Without the garbage collector: a dropped block and a replaced parameter are freed
    as soon as nothing else refers to them (no reference cycle, no strong reference)."""
    gc.disable()
    try:
        block, x, probs, splits, grad_y = warmed()
        old_weight = weakref.ref(block[0].weight)
        block[0].weight = torch.nn.Parameter(torch.randn_like(block[0].weight))
        assert old_weight() is None
        run(block, x, probs, splits, grad_y)
        with torch.no_grad():
            for _ in range(3):
                block(x, *extras(block, splits, probs))
        alive = [weakref.ref(block), weakref.ref(fuser_of(block)), weakref.ref(block[2].weight)]
        del block
        assert [ref() for ref in alive] == [None, None, None]
    finally:
        gc.enable()
