"""Compiled fuser calls as one in-graph function (fusible_ops.fuser.compiled): few guards,
and every fact the plan depends on still recompiles when it changes."""

from __future__ import annotations

import copy

import pytest
import torch
from error_model import BOTH_SIDES, expert_block_terms, tolerance
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import make_boxed_func

import fusible_ops as fo
from fusible_ops.fuser.compiled import fuser_in_graph
from fusible_ops.kernels.activation import ActivationSpec

EXPERTS, HIDDEN, FFN = 4, 16, 24
SIZES = [3, 0, 5, 4]
# compiled vs eager in float32, both rounding (<= 12 rows a group, condition <= 4)
FP32_TOL = tolerance(torch.float32, expert_block_terms(HIDDEN, FFN, 12), condition=4 * BOTH_SIDES)


def expert_block(activation: type = fo.ScaledSwiGLU, linear: type = fo.GroupedLinear) -> fo.Sequential:
    torch.manual_seed(0)
    return fo.Sequential(linear(EXPERTS, HIDDEN, 2 * FFN), activation(), linear(EXPERTS, FFN, HIDDEN))


def inputs(sizes=SIZES, seed=1):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    x = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64).float().requires_grad_()
    probs = torch.rand(rows, generator=gen).requires_grad_()
    return x, probs, torch.tensor(sizes)


def forward_backward(fn, seq, x, probs, splits):
    out = fn(x, splits, probs, splits)
    grads = torch.autograd.grad(out.square().sum(), [x, probs, *seq.parameters()])
    return out, grads


def assert_equal_to_eager(compiled, seq, x, probs, splits):
    out, grads = forward_backward(compiled, seq, x, probs, splits)
    want_out, want_grads = forward_backward(seq, seq, x, probs, splits)
    torch.testing.assert_close(out, want_out, **FP32_TOL)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, **FP32_TOL)


class Graphs:
    """A backend that keeps Dynamo's graph and the forward graph AOTAutograd makes of it."""

    def __init__(self) -> None:
        self.dynamo: list[str] = []
        self.in_graph_calls: list[int] = []
        self.aot: list[str] = []

        def keep(gm, example_inputs):
            self.aot.append(gm.print_readable(print_output=False))
            return make_boxed_func(gm.forward)

        self._aot = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm.print_readable(print_output=False))
        self.in_graph_calls.append(sum(node.target is fuser_in_graph for node in gm.graph.nodes))
        return self._aot(gm, example_inputs)


def count_guards(fn) -> int:
    """Leaf guards of the first compiled entry of ``fn``'s code (what every call checks)."""

    def leaves(manager) -> int:
        return len(manager.get_leaf_guards()) + sum(leaves(child) for child in manager.get_child_managers())

    entry = _debug_get_cache_entry_list(fn.__code__)[0]
    return leaves(entry.guard_manager.root)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class MyGroupedLinear(fo.GroupedLinear):
    """A subclass: it may read anything, so its calls are traced through."""


def test_library_block_compiles_to_one_in_graph_call_of_the_fused_op():
    seq = expert_block()
    graphs = Graphs()
    compiled = torch.compile(seq, backend=graphs, fullgraph=True)
    assert_equal_to_eager(compiled, seq, *inputs())
    assert len(graphs.dynamo) == 1
    assert graphs.in_graph_calls == [1]
    assert "grouped_mlp" not in graphs.dynamo[0]
    assert "fusible_ops.grouped_mlp_forward" in graphs.aot[0]


def test_traced_through_where_an_op_is_not_the_librarys_own():
    seq = expert_block(linear=MyGroupedLinear)
    graphs = Graphs()
    compiled = torch.compile(seq, backend=graphs, fullgraph=True)
    assert_equal_to_eager(compiled, seq, *inputs())
    assert graphs.in_graph_calls == [0]
    assert "grouped_mlp_forward" in graphs.dynamo[0]


def test_compiled_call_checks_far_fewer_guards_than_a_traced_through_one():
    def run(seq):
        def step(x, splits, probs):
            return seq(x, splits, probs, splits)

        x, probs, splits = inputs()
        torch.compile(step, backend="aot_eager", fullgraph=True)(x, splits, probs)
        count = count_guards(step)
        torch._dynamo.reset()
        return count

    in_graph, traced = run(expert_block()), run(expert_block(linear=MyGroupedLinear))
    # measured (torch 2.13, the leaf guards this walk reaches): 50 against 296
    assert in_graph * 2 < traced, (in_graph, traced)


def test_dynamo_eager_backend_runs_the_call_eagerly():
    seq = expert_block()
    compiled = torch.compile(seq, backend="eager", fullgraph=True)
    assert_equal_to_eager(compiled, seq, *inputs())


def test_aot_autograd_cache_refuses_the_in_graph_call():
    """The call refers to a fuser of this process: a cached graph must never be reused."""
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe

    seq = expert_block()
    nodes = []

    def keep(gm, example_inputs):
        nodes.extend(n for n in gm.graph.nodes if n.target is fuser_in_graph)
        return gm.forward

    x, probs, splits = inputs()
    torch.compile(seq, backend=keep, fullgraph=True)(x, splits, probs, splits)
    assert len(nodes) == 1
    with pytest.raises(BypassAOTAutogradCache):
        check_node_safe(nodes[0])


def test_settings_change_recompiles_and_runs_unfused():
    seq = expert_block()
    graphs = Graphs()
    counter = CompileCounterWithBackend(graphs)
    compiled = torch.compile(seq, backend=counter, fullgraph=True)
    x, probs, splits = inputs()
    assert_equal_to_eager(compiled, seq, x, probs, splits)
    with fo.settings(fusion=False):
        assert_equal_to_eager(compiled, seq, x, probs, splits)
    assert counter.frame_count == 2
    assert "grouped_mlp_forward" in graphs.aot[0]
    assert "grouped_mlp_forward" not in graphs.aot[-1]
    assert_equal_to_eager(compiled, seq, x, probs, splits)
    assert counter.frame_count == 2  # the first graph again


def test_changing_an_ops_configuration_recompiles_with_the_new_math():
    seq = expert_block(activation=fo.ScaledClampedSwiGLU)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(seq, backend=counter, fullgraph=True)
    x, probs, splits = inputs()
    before = compiled(x, splits, probs, splits).detach()
    assert counter.frame_count == 1
    with pytest.raises(AttributeError, match="fixed at construction"):
        seq[1].spec = ActivationSpec("clamped_swiglu", limit=0.05)
    seq[1] = fo.ScaledClampedSwiGLU(limit=0.05)  # a new op that clamps hard: changes the result
    assert_equal_to_eager(compiled, seq, x, probs, splits)
    assert counter.frame_count > 1  # recompiled (a changed float is traced twice in torch 2.13)
    assert not torch.allclose(before, compiled(x, splits, probs, splits))


def compilations_around(change) -> int:
    """Compilations of an expert block called, ``change(seq)``, called again (each call
    checked against eager)."""
    seq = expert_block()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(seq, backend=counter, fullgraph=True)
    x, probs, splits = inputs()
    assert_equal_to_eager(compiled, seq, x, probs, splits)
    change(seq)
    assert_equal_to_eager(compiled, seq, x, probs, splits)
    return counter.frame_count


def test_train_and_eval_are_guarded():
    assert compilations_around(lambda seq: seq.eval()) == 2


def test_a_users_fusion_rule_makes_calls_traced_through_and_is_applied():
    seen = []

    def user_rule(entries, context):
        seen.append(len(entries))
        return entries

    seq = expert_block()
    graphs = Graphs()
    compiled = torch.compile(seq, backend=graphs, fullgraph=True)
    x, probs, splits = inputs()
    assert_equal_to_eager(compiled, seq, x, probs, splits)
    fo.register_fusion(user_rule, kind="forward")
    try:
        seen.clear()
        assert_equal_to_eager(compiled, seq, x, probs, splits)
        assert seen  # the rule ran (while tracing, and in the eager reference)
        assert graphs.in_graph_calls[-1] == 0
    finally:
        fo.unregister_fusion(user_rule)


def test_hooks_on_an_op_fire_under_compile():
    seq = expert_block()
    fired = []
    seq[0].register_forward_hook(lambda module, args, output: fired.append(tuple(output.shape)))
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    x, probs, splits = inputs()
    assert_equal_to_eager(compiled, seq, x, probs, splits)
    assert fired == [(sum(SIZES), 2 * FFN)] * 2  # compiled, then eager


def test_functional_call_under_compile_differentiates_the_given_parameters():
    seq = expert_block()
    x, probs, splits = inputs()
    new = {name: (p.detach() * 0.5).requires_grad_() for name, p in seq.named_parameters()}

    def call(params, x, probs, splits):
        return torch.func.functional_call(seq, params, (x, splits, probs, splits))

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    out = compiled(new, x, probs, splits)
    grads = torch.autograd.grad(out.square().sum(), list(new.values()))
    ref = {name: t.detach().clone().requires_grad_() for name, t in new.items()}
    want = call(ref, x, probs, splits)
    want_grads = torch.autograd.grad(want.square().sum(), list(ref.values()))
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)
    for p in seq.parameters():
        assert p.grad is None  # the module's own weights got nothing


def test_fuser_keys():
    seq = expert_block()
    fuser = seq._get_groups()[0][1]
    assert fuser.compiled_key is not None
    twin = copy.deepcopy(seq)._get_groups()[0][1]
    assert twin.compiled_key not in (None, fuser.compiled_key)
    assert expert_block(linear=MyGroupedLinear)._get_groups()[0][1].compiled_key is None


def test_moe_layer_compiles_its_experts_to_one_in_graph_call():
    torch.manual_seed(0)
    moe = fo.MoE(8, 16, 4, 2)
    graphs = Graphs()
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = torch.compile(moe, backend=graphs, fullgraph=True)(x)
    torch.testing.assert_close(out, moe(x), **FP32_TOL)  # hidden 8 <= HIDDEN, ffn 16 <= FFN
    assert graphs.in_graph_calls == [1]


def test_a_rule_without_a_module_counts_as_a_users():
    from fusible_ops.fuser.rules import registry_state

    def rule(entries, context):
        return entries

    rule.__module__ = None  # as for a function made by exec
    fo.register_fusion(rule, kind="forward")
    try:
        assert registry_state()[1] is False
    finally:
        fo.unregister_fusion(rule)
    assert registry_state()[1] is True


def test_a_backend_registry_change_recompiles():
    from fusible_ops.kernels import clear_backend_cache

    # clear_backend_cache: what registering or unregistering a backend does
    assert compilations_around(lambda seq: clear_backend_cache()) == 2


def test_settings_are_per_thread_under_compile():
    """Each thread's settings are guarded: one thread's ``fusion=False`` is not another's."""
    import threading

    seq = expert_block()
    graphs = Graphs()
    compiled = torch.compile(seq, backend=graphs, fullgraph=True)
    x, probs, splits = inputs()
    with torch.no_grad():
        want = seq(x, splits, probs, splits)
        compiled(x, splits, probs, splits)
        seen = {}

        def unfused_call():
            with fo.settings(fusion=False):
                seen["out"] = compiled(x, splits, probs, splits)

        worker = threading.Thread(target=unfused_call)
        worker.start()
        worker.join()
        torch.testing.assert_close(seen["out"], want, **FP32_TOL)
        assert "grouped_mlp_forward" not in graphs.aot[-1]  # the worker's graph: unfused
        count = len(graphs.aot)
        torch.testing.assert_close(compiled(x, splits, probs, splits), want, **FP32_TOL)
    assert len(graphs.aot) == count  # this thread's settings: its first graph again
    assert "grouped_mlp_forward" in graphs.aot[0]


def test_replacing_an_op_after_compiling_uses_the_new_op():
    seq = expert_block()
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    x, probs, splits = inputs()
    compiled(x, splits, probs, splits)
    torch.manual_seed(5)
    seq[2] = fo.GroupedLinear(EXPERTS, FFN, HIDDEN)
    assert_equal_to_eager(compiled, seq, x, probs, splits)
    seq._modules["0"] = fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN)  # not through __setitem__
    assert_equal_to_eager(compiled, seq, x, probs, splits)
