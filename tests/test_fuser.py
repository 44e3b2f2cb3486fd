"""OperationFuser: plans and their reasons, run-time fusion rules of every kind, re-planning,
saved tensors going through autograd's saved-tensor hooks, and explain() computing nothing."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import reference_ops as ref
import torch

import fusible_ops as fo

SPLITS = [5, 0, 7, 4]
ROWS, HIDDEN, FFN, EXPERTS = 16, 8, 6, 4


def expert_block(dtype=torch.float32) -> fo.Sequential:
    return fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(EXPERTS, FFN, HIDDEN, dtype=dtype),
    )


def block_inputs(dtype=torch.float32, requires_grad=True):
    x = torch.randn(ROWS, HIDDEN, dtype=dtype, requires_grad=requires_grad)
    probs = torch.rand(ROWS, dtype=dtype, requires_grad=requires_grad)
    return x, probs


@contextlib.contextmanager
def registered(rule, kind, prepend=False):
    fo.register_fusion(rule, kind=kind, prepend=prepend)
    try:
        yield rule
    finally:
        fo.unregister_fusion(rule)


# ---------------------------------------------------------------- plan structure


def test_plan_structure_for_the_expert_block():
    seq = expert_block()
    x, probs = block_inputs()
    seq(x, SPLITS, probs, SPLITS)
    plan = seq.last_plan
    assert isinstance(plan, fo.SequentialPlan) and len(plan.groups) == 1
    group = plan.fusion_plans[0]
    assert isinstance(group, fo.FusionPlan)
    assert group.op_names == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    assert group.forward_op_types() == ["GroupedMLP"] and group.backward_op_types() == ["GroupedMLP"]
    assert group.forward[0].indices == (0, 1, 2) and group.forward[0].backend_name
    assert group.requires_grad and group.fusion_enabled and group.dtype == torch.float32
    (decision,) = group.fired
    assert isinstance(decision, fo.FusionDecision)
    assert (decision.rule, decision.kind, decision.indices, decision.fired) == (
        "grouped_mlp",
        "joint",
        (0, 1, 2),
        True,
    )
    assert decision.backend == group.forward[0].backend_name
    text = str(plan)
    assert "GroupedMLP(ops 0..2)" in text and "grouped_mlp (joint) fired on ops 0..2" in text


def test_declined_fusions_carry_reasons_and_results_stay_correct():
    seq = expert_block(torch.float64)
    x, probs = block_inputs(torch.float64)
    fc1_out = torch.empty(ROWS, 2 * FFN, dtype=torch.float64)
    out = seq(x, SPLITS, probs, SPLITS, op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: fc1_out}})
    group = seq.last_plan.fusion_plans[0]
    assert group.forward_op_types() == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    (declined,) = group.declined
    assert declined.rule == "grouped_mlp" and not declined.fired
    assert "output buffer requested on fc1" in declined.reason
    assert "declined on ops 0..2: output buffer requested on fc1" in str(group)
    expected = ref.expert_block(
        x.detach(), seq[0].weight.detach(), probs.detach(), seq[2].weight.detach(), SPLITS
    )
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(fc1_out, ref.grouped_linear(x.detach(), seq[0].weight.detach(), None, SPLITS))

    grad_buf = torch.empty(ROWS, FFN, dtype=torch.float64)
    plan = seq.explain(x, SPLITS, probs, SPLITS, op_kwargs={2: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}})
    assert "grad_input buffer requested on fc2" in plan.decisions[0].reason

    plan = seq.explain(x, SPLITS, probs, [4, 1, 7, 4])
    assert "fc1 and fc2 receive different split sizes" in plan.decisions[0].reason

    mixed = fo.Sequential(
        fo.GroupedLinear(4, HIDDEN, 2 * FFN), fo.ScaledSwiGLU(), fo.GroupedLinear(2, FFN, HIDDEN)
    )
    plan = mixed.explain(torch.randn(ROWS, HIDDEN), SPLITS, torch.rand(ROWS), [8, 8])
    assert "fc1.num_groups (4) != fc2.num_groups (2)" in plan.decisions[0].reason


def test_plan_without_grad_and_plain_module_groups():
    seq = fo.Sequential(*expert_block(), torch.nn.Tanh(), fo.ReLU())
    x, probs = block_inputs(requires_grad=False)
    with torch.no_grad():
        seq(x, SPLITS, probs, SPLITS)
    plan = seq.last_plan
    assert [type(g).__name__ for g in plan.groups] == ["FusionPlan", "str", "FusionPlan"]
    assert plan.groups[1] == "Tanh"
    assert not plan.fusion_plans[0].requires_grad
    assert "backward: (not needed: nothing requires grad)" in str(plan.fusion_plans[0])
    assert "group 1: plain module Tanh" in str(plan)


# ---------------------------------------------------------------- run-time rules of each kind


def _product(ops) -> float:
    result = 1.0
    for op in ops:
        result *= getattr(op, "scale", 1.0)  # Identity counts as 1
    return result


class CountingFused(fo.FusedOperation):
    calls = {"forward": 0, "backward": 0}

    @classmethod
    def reset(cls):
        cls.calls = {"forward": 0, "backward": 0}


class ProductForward(CountingFused):
    """Forward of ConstantScale -> ConstantScale as one multiply (they save nothing)."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        type(self).calls["forward"] += 1
        return input_ * _product(self.basic_ops), [(), ()]


class ProductBackward(CountingFused):
    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        type(self).calls["backward"] += 1
        return grad_output * _product(self.basic_ops), [[], []], [(), ()]


class ProductJoint(ProductForward, ProductBackward):
    pass


def scale_pair_rule(name, fused_cls):
    return fo.window_rule(name, (fo.ConstantScale, fo.ConstantScale), lambda ctx, ops, first: fused_cls(ops))


@pytest.mark.parametrize(
    "kind,cls", [("forward", ProductForward), ("backward", ProductBackward), ("joint", ProductJoint)]
)
def test_register_fusion_each_kind(kind, cls):
    seq = fo.Sequential(fo.ConstantScale(2.0), fo.ConstantScale(-3.0), fo.ReLU())
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    seq(x)
    assert seq.last_plan.fusion_plans[0].forward_op_types() == ["ConstantScale", "ConstantScale", "ReLU"]
    cls.reset()
    with registered(scale_pair_rule(f"scale_pair_{kind}", cls), kind):
        y = seq(x)  # the registry changed: the fuser re-plans
        plan = seq.last_plan.fusion_plans[0]
        y.backward(torch.ones_like(y))
        assert torch.autograd.gradcheck(seq, (x,))
    fused_forward = kind in ("forward", "joint")
    fused_backward = kind in ("backward", "joint")
    assert plan.forward_op_types() == ([cls.__name__] if fused_forward else ["ConstantScale"] * 2) + ["ReLU"]
    assert plan.backward_op_types() == ([cls.__name__] if fused_backward else ["ConstantScale"] * 2) + [
        "ReLU"
    ]
    assert [(d.rule, d.kind, d.fired) for d in plan.decisions] == [(f"scale_pair_{kind}", kind, True)]
    assert (cls.calls["forward"] > 0) == fused_forward and (cls.calls["backward"] > 0) == fused_backward
    torch.testing.assert_close(y, torch.relu(-6.0 * x.detach()))
    torch.testing.assert_close(x.grad, -6.0 * (-6.0 * x.detach() > 0).double())
    seq(x)  # unregistered again: back to the basic ops
    assert seq.last_plan.fusion_plans[0].forward_op_types() == ["ConstantScale", "ConstantScale", "ReLU"]


def test_register_fusion_order_and_prepend():
    first = scale_pair_rule("first", ProductJoint)
    second = scale_pair_rule("second", ProductJoint)
    seq = fo.Sequential(fo.ConstantScale(2.0), fo.ConstantScale(3.0))
    x = torch.randn(3, 2)
    with registered(first, "joint"), registered(second, "joint"):
        seq(x)
        assert [d.rule for d in seq.last_plan.decisions] == ["first"]  # the window is consumed
    with registered(first, "joint"), registered(second, "joint", prepend=True):
        seq(x)
        assert [d.rule for d in seq.last_plan.decisions] == ["second"]
    with pytest.raises(ValueError, match="kind must be one of"):
        fo.register_fusion(first, kind="sideways")


def test_window_rule_scans_consumes_and_logs_declines():
    def build(context, ops, first):
        if any(getattr(op, "scale", 1.0) < 0 for op in ops):
            return "a negative scale: declined"
        return ProductJoint(ops)

    # the first slot accepts either type
    rule = fo.window_rule("pair", ((fo.ConstantScale, fo.Identity), fo.ConstantScale), build)
    seq = fo.Sequential(
        fo.ConstantScale(-1.0),
        fo.ConstantScale(2.0),
        fo.ConstantScale(3.0),
        fo.ReLU(),
        fo.Identity(),
        fo.ConstantScale(5.0),
    )
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    with registered(rule, "joint"):
        y = seq(x)
        plan = seq.last_plan.fusion_plans[0]
        assert torch.autograd.gradcheck(seq, (x,))
    assert [(d.indices, d.fired, d.reason) for d in plan.decisions] == [
        ((0, 1), False, "a negative scale: declined"),
        ((1, 2), True, ""),
        ((4, 5), True, ""),
    ]
    assert plan.forward_op_types() == ["ConstantScale", "ProductJoint", "ReLU", "ProductJoint"]
    assert "- pair (joint) declined on ops 0..1: a negative scale: declined" in str(plan)
    torch.testing.assert_close(y, 5.0 * torch.relu(-6.0 * x.detach()))


# ---------------------------------------------------------------- re-planning


def test_replans_on_grad_dtype_settings_and_autocast_and_caches_otherwise():
    seq = expert_block()
    x, probs = block_inputs()
    seq(x, SPLITS, probs, SPLITS)
    plan = seq.last_plan.fusion_plans[0]
    seq(x, SPLITS, probs, SPLITS)
    assert seq.last_plan.fusion_plans[0] is plan, "an identical call should reuse the cached plan"

    with torch.no_grad():
        seq(x, SPLITS, probs, SPLITS)
    assert not seq.last_plan.fusion_plans[0].requires_grad

    seq(x.detach(), SPLITS, probs.detach(), SPLITS)  # parameters still need grad
    assert seq.last_plan.fusion_plans[0].requires_grad
    for p in seq.parameters():
        p.requires_grad_(False)
    seq(x.detach(), SPLITS, probs.detach(), SPLITS)
    assert not seq.last_plan.fusion_plans[0].requires_grad
    for p in seq.parameters():
        p.requires_grad_(True)

    seq.double()
    seq(x.double(), SPLITS, probs.double(), SPLITS)
    assert seq.last_plan.fusion_plans[0].dtype == torch.float64
    seq.float()

    with fo.settings(fusion=False):
        seq(x, SPLITS, probs, SPLITS)
        unfused = seq.last_plan.fusion_plans[0]
    assert not unfused.fusion_enabled and unfused.decisions == []
    assert unfused.forward_op_types() == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    assert "fusion=off" in str(unfused)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = seq(x, SPLITS, probs, SPLITS)
    assert seq.last_plan.fusion_plans[0].dtype == torch.bfloat16 and y.dtype == torch.bfloat16

    seq(x, SPLITS, probs, SPLITS)
    assert seq.last_plan.fusion_plans[0] is plan, "back to the first configuration: the cached plan"


def test_fusion_off_matches_fused_and_reference():
    seq = expert_block(torch.float64)
    x, probs = block_inputs(torch.float64)
    results = {}
    for fusion in (True, False):
        with fo.settings(fusion=fusion):
            y = seq(x, SPLITS, probs, SPLITS)
            types = seq.last_plan.fusion_plans[0].forward_op_types()
        grads = torch.autograd.grad(y.sum(), [x, probs, *seq.parameters()])
        results[fusion] = (types, y.detach(), grads)
    assert results[True][0] == ["GroupedMLP"]
    assert results[False][0] == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-12, atol=1e-12)
    for a, b in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="unknown setting"):
        with fo.settings(fusoin=False):
            pass


@pytest.mark.parametrize(
    "changes",
    [
        {"fusion": "false"},
        {"fusion": 0},
        {"fusion": None},
        {"fusion": 1},
        {"triton_autotune": "no"},
        {"backend": None},
        {"backend": 3},
    ],
)
def test_settings_values_of_the_wrong_type_are_refused(changes):
    name = next(iter(changes))
    with pytest.raises(TypeError, match=f"settings: {name} must be a"):
        with fo.settings(**changes):
            pass
    assert fo.current_settings() == fo.Settings()  # nothing was pushed


def test_settings_types_cover_every_setting():
    from fusible_ops.core.settings import _TYPES

    special = {"recipe"}  # a fusible_ops.recipes recipe or None, checked by settings() itself
    assert set(_TYPES) | special == {f.name for f in __import__("dataclasses").fields(fo.Settings)}
    for name, value in fo.Settings().__dict__.items():
        if name not in special:
            assert type(value) is _TYPES[name]


def _dropping_rule(entries, context):
    return entries[1:]  # loses op 0: the math would silently change


def _repeating_rule(entries, context):
    return [entries[0], *entries]


def _reordering_rule(entries, context):
    return list(reversed(entries))


def _wrong_ops_rule(entries, context):
    from fusible_ops.fuser.plan import PlanEntry

    first = entries[0]
    return [PlanEntry(entries[1].op, first.indices), *entries[1:]]  # op 1 claims to be op 0


@pytest.mark.parametrize("kind", ["joint", "forward", "backward"])
@pytest.mark.parametrize(
    "rule, message",
    [
        (_dropping_rule, "covering ops"),
        (_repeating_rule, "covering ops"),
        (_reordering_rule, "covering ops"),
        (_wrong_ops_rule, "holds"),
    ],
)
def test_a_rule_that_does_not_cover_every_op_once_in_order_is_refused(kind, rule, message):
    seq = expert_block()
    x, probs = block_inputs()
    # a buffer on fc1 keeps GroupedMLP from firing, so every rule kind sees three entries
    out_buf = torch.full((ROWS, 2 * FFN), 7.0)
    weights = [p.detach().clone() for p in seq.parameters()]
    with registered(rule, kind, prepend=True):
        with pytest.raises(RuntimeError, match=f"fusion rule '{rule.__name__}' \\({kind}\\).*{message}"):
            seq(x, SPLITS, probs, SPLITS, op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: out_buf}})
    assert torch.all(out_buf == 7.0)  # refused before anything ran
    assert all(torch.equal(p, w) for p, w in zip(seq.parameters(), weights))
    assert x.grad is None
    seq(x, SPLITS, probs, SPLITS).sum().backward()  # the next call, rule gone, works
    assert x.grad is not None


# ---------------------------------------------------------------- saved tensors


class SavedTensorLog:
    """Saved-tensor hooks that keep every saved tensor as a private clone (like offloading)."""

    def __init__(self):
        self.packed: list[torch.Tensor] = []
        self.unpacked = 0

    def pack(self, t: torch.Tensor):
        self.packed.append(t.detach().clone())
        return len(self.packed) - 1

    def unpack(self, index: int) -> torch.Tensor:
        self.unpacked += 1
        return self.packed[index]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed)


@pytest.mark.parametrize("fusion", [True, False])
def test_saved_tensors_go_through_hooks_only(fusion):
    seq = expert_block(torch.float64)
    x, probs = block_inputs(torch.float64)
    with fo.settings(fusion=fusion):
        y_plain = seq(x, SPLITS, probs, SPLITS)
        expected = torch.autograd.grad(y_plain.sum(), [x, probs, *seq.parameters()])
        log = SavedTensorLog()
        with log.hooks():
            y = seq(x, SPLITS, probs, SPLITS)
        # no tensor may sit on the op contexts besides what went through save_for_backward
        for ctx in y.grad_fn.ctxs:
            stashed = [k for k, v in vars(ctx).items() if isinstance(v, torch.Tensor)]
            assert stashed == [], f"tensors stashed on the context: {stashed}"
        # scribble over the input: backward must use the hooks' copies, not a stashed reference
        with torch.no_grad():
            x_saved = x.detach().clone()
            x.mul_(-3.0)
        grads = torch.autograd.grad(y.sum(), [x, probs, *seq.parameters()])
        with torch.no_grad():
            x.copy_(x_saved)
    assert log.packed and log.unpacked == len(log.packed)
    for a, b in zip(grads, expected):
        assert torch.equal(a, b)


class ActivationLog(SavedTensorLog):
    """Logs saved tensors other than parameters (those cost no memory: autograd keeps the
    parameter itself, as it does for ``torch.nn.Linear``)."""

    def __init__(self, params):
        super().__init__()
        self.param_ptrs = {p.data_ptr() for p in params}

    def pack(self, t):
        if t.data_ptr() in self.param_ptrs:
            return ("param", t)
        return super().pack(t)

    def unpack(self, packed):
        return packed[1] if isinstance(packed, tuple) else super().unpack(packed)


def test_fused_op_saves_input_fc1_output_scales_and_offsets_only():
    seq = expert_block()
    x, probs = block_inputs()
    sizes = {}
    for fusion in (True, False):
        log = ActivationLog(seq.parameters())
        with fo.settings(fusion=fusion), log.hooks():
            seq(x, SPLITS, probs, SPLITS)
        sizes[fusion] = log
    fused = sizes[True]
    shapes = sorted(tuple(t.shape) for t in fused.packed)
    assert shapes == sorted([(ROWS, HIDDEN), (ROWS, 2 * FFN), (ROWS,), (EXPERTS,)]), shapes
    budget = 4 * (ROWS * HIDDEN + ROWS * 2 * FFN + ROWS) + 8 * EXPERTS
    assert fused.nbytes() <= budget < sizes[False].nbytes()


def test_saved_tensors_of_every_basic_op_use_hooks():
    ops = fo.Sequential(
        fo.LayerNorm(6),
        fo.BasicLinear(6, 8),
        fo.Bias(8),
        fo.GELU(),
        fo.Dropout(0.2),
        fo.RMSNorm(8),
        fo.SwiGLU(),
        fo.Scale(),
        fo.ConstantScale(2.0),
    )
    x = torch.randn(5, 6, requires_grad=True)
    scales = torch.rand(5, requires_grad=True)
    with fo.settings(fusion=False):
        log = SavedTensorLog()
        with log.hooks():
            y = ops(x, scales)
        for ctx in y.grad_fn.ctxs:
            assert not [k for k, v in vars(ctx).items() if isinstance(v, torch.Tensor)]
        y.sum().backward()
    assert log.unpacked == len(log.packed) > 0
    assert x.grad is not None and scales.grad is not None
    assert all(p.grad is not None for p in ops.parameters())


# ---------------------------------------------------------------- explain


def test_explain_computes_nothing_and_matches_the_call():
    seq = expert_block()
    x, probs = block_inputs()
    out_buf = torch.full((ROWS, HIDDEN), 7.0)
    grad_buf = torch.full((ROWS, HIDDEN), 7.0)
    op_kwargs = {2: {fo.OUTPUT_BUFFER_KEY: out_buf}, 0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}
    weights = [p.detach().clone() for p in seq.parameters()]
    plan = seq.explain(x, SPLITS, probs, SPLITS, op_kwargs=op_kwargs)
    assert torch.all(out_buf == 7.0) and torch.all(grad_buf == 7.0)
    assert x.grad is None and probs.grad is None and all(p.grad is None for p in seq.parameters())
    assert all(torch.equal(p, w) for p, w in zip(seq.parameters(), weights))
    assert seq.last_plan is None  # nothing ran
    assert plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"]
    seq(x, SPLITS, probs, SPLITS, op_kwargs=op_kwargs)
    assert str(seq.last_plan) == str(plan)
    with pytest.raises(ValueError, match="expected 3 extra input"):
        seq.explain(x, SPLITS, probs)


# ---------------------------------------------------------------- last_plan per thread


def test_last_plan_is_the_plan_of_this_threads_call():
    import threading

    seq = expert_block()
    barrier = threading.Barrier(2)
    seen: dict[str, bool] = {}
    errors: list[BaseException] = []

    def worker(name: str, fusion: bool) -> None:
        try:
            x, probs = block_inputs()
            for _ in range(20):
                with fo.settings(fusion=fusion):
                    seq(x, SPLITS, probs, SPLITS)
                barrier.wait()  # the other thread has made its call too
                seen[name] = seq.last_plan.fusion_plans[0].fusion_enabled
                assert seen[name] is fusion, f"thread {name!r} read the other thread's plan"
                barrier.wait()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(n, f)) for n, f in (("on", True), ("off", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert seen == {"on": True, "off": False}


# ---------------------------------------------------------------- regressions found in review


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


def test_split_sizes_made_invalid_through_numpy_between_calls_raise():
    """What a call derived from the values (the checks they passed) is kept only while a
    fresh read finds the same values: a write that breaks them is caught."""
    np = pytest.importorskip("numpy")
    lin = fo.GroupedLinear(2, 4, 4)
    x = torch.randn(4, 4)
    sizes_np = np.array([1, 3])
    splits = torch.from_numpy(sizes_np)
    lin(x, splits)
    lin(x, splits)  # same values: the earlier checks and offsets are reused
    sizes_np[:] = [3, 3]
    with pytest.raises(ValueError, match="GroupedLinear: split_sizes sum to 6 but the input has 4 rows"):
        lin(x, splits)
    sizes_np[:] = [-1, 5]
    with pytest.raises(ValueError, match="GroupedLinear: split_sizes must be non-negative"):
        lin(x, splits)
