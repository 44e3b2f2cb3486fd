"""Sequential: the DESIGN 1 usage, op_kwargs resolution and its errors, the container protocol."""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch
from error_model import expert_block_terms, rounding_rtol

import fusible_ops as fo

SPLITS = [5, 0, 7, 4]
ROWS, HIDDEN, FFN, EXPERTS = 16, 8, 6, 4


def expert_block(dtype=torch.float32) -> fo.Sequential:
    return fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(EXPERTS, FFN, HIDDEN, dtype=dtype),
    )


def block_inputs(dtype=torch.float32):
    x = torch.randn(ROWS, HIDDEN, dtype=dtype, requires_grad=True)
    probs = torch.rand(ROWS, dtype=dtype, requires_grad=True)
    return x, probs


def reference(seq: fo.Sequential, x, probs):
    x_ref, p_ref = ref.leaf(x), ref.leaf(probs)
    w1, w2 = ref.leaf(seq[0].weight), ref.leaf(seq[2].weight)
    y = ref.expert_block(x_ref, w1, p_ref, w2, SPLITS)
    return y, (x_ref, p_ref, w1, w2)


def test_design_usage_verbatim():
    num_experts, hidden, ffn = EXPERTS, HIDDEN, FFN
    x, probs = block_inputs()
    split_sizes = torch.tensor(SPLITS)
    combine_buf = torch.full((ROWS + 3, hidden), -7.0)
    dispatch_grad_buf = torch.full((ROWS, hidden), -7.0)

    experts = fo.Sequential(
        fo.GroupedLinear(num_experts, hidden, 2 * ffn),  # fc1: gate and up projections
        fo.ScaledSwiGLU(),  # silu(gate) * up * routing prob
        fo.GroupedLinear(num_experts, ffn, hidden),  # fc2: down projection
    )
    out = experts(
        x,
        split_sizes,
        probs,
        split_sizes,  # extra inputs, in op order
        op_kwargs={
            experts[2]: {fo.OUTPUT_BUFFER_KEY: combine_buf},  # fc2 writes here
            0: {fo.GRAD_INPUT_BUFFER_KEY: dispatch_grad_buf},
        },  # fc1's dgrad lands here
    )
    assert out.data_ptr() == combine_buf.data_ptr()
    assert torch.all(combine_buf[ROWS:] == -7.0)
    dy = torch.randn_like(out)
    out.backward(dy)
    assert torch.equal(x.grad, dispatch_grad_buf)

    y_ref, (x_ref, p_ref, w1, w2) = reference(experts, x, probs)
    y_ref.backward(dy.double())
    for actual, expected in (
        (out, y_ref),
        (x.grad, x_ref.grad),
        (probs.grad, p_ref.grad),
        (experts[0].weight.grad, w1.grad),
        (experts[2].weight.grad, w2.grad),
    ):
        # float32 vs float64, relative to the largest entry (<= 7 rows a group, condition <= 4)
        assert ref.max_rel_err(actual, expected) < rounding_rtol(
            torch.float32, expert_block_terms(HIDDEN, FFN, 7), condition=4
        )


@pytest.mark.parametrize("key", ["module", "index", "negative_index"])
def test_op_kwargs_key_forms_are_equivalent(key):
    seq = expert_block()
    x, probs = block_inputs()
    expected = seq(x, SPLITS, probs, SPLITS)
    buf = torch.empty(ROWS, HIDDEN)
    op_key = {"module": seq[2], "index": 2, "negative_index": -1}[key]
    out = seq(x, SPLITS, probs, SPLITS, op_kwargs={op_key: {fo.OUTPUT_BUFFER_KEY: buf}})
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(out, expected)

    grad_buf = torch.empty(ROWS, HIDDEN)
    first_key = {"module": seq[0], "index": 0, "negative_index": -3}[key]
    out = seq(x, SPLITS, probs, SPLITS, op_kwargs={first_key: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}})
    out.sum().backward()
    assert torch.equal(grad_buf, x.grad)


# ---------------------------------------------------------------- op_kwargs errors


def _stranger():
    return fo.GroupedLinear(EXPERTS, FFN, HIDDEN)


OP_KWARGS_ERRORS = [
    # (name, op_kwargs builder, exception type, message regex)
    ("op not in the Sequential", lambda s: {_stranger(): {}}, ValueError, "not a module of this Sequential"),
    ("index out of range", lambda s: {5: {}}, ValueError, r"op_kwargs key 5 is out of range .* 5 modules"),
    ("negative index out of range", lambda s: {-6: {}}, ValueError, r"op_kwargs key -6 is out of range"),
    ("plain nn.Module by index", lambda s: {3: {}}, ValueError, r"index 3 names Tanh .* not a fusible op"),
    ("plain nn.Module by object", lambda s: {s[3]: {}}, ValueError, r"Tanh .* not a fusible op"),
    ("same op twice", lambda s: {s[2]: {}, -3: {}}, ValueError, r"gives op 2 \(GroupedLinear\) twice"),
    (
        "string key",
        lambda s: {"fc2": {}},
        ValueError,
        r"key 'fc2' must be a module of this Sequential or an int",
    ),
    (
        "misspelled kwarg",
        lambda s: {2: {"outptu": torch.empty(ROWS, HIDDEN)}},
        TypeError,
        r"GroupedLinear got unexpected kwarg\(s\) \['outptu'\]; it accepts \['grad_input', 'output', 'quantized_input'\]",
    ),
    (
        "kwarg on an op without kwargs",
        lambda s: {1: {"output": None}},
        TypeError,
        r"ScaledSwiGLU got unexpected",
    ),
    ("non-mapping value", lambda s: {0: [1, 2]}, TypeError, r"value for index 0 must be a mapping"),
    ("non-mapping op_kwargs", lambda s: [(0, {})], TypeError, r"op_kwargs must be a mapping"),
]


def block_with_plain_module() -> fo.Sequential:
    # fused group [0..2], plain torch module 3, basic op 4
    return fo.Sequential(*expert_block(), torch.nn.Tanh(), fo.ReLU())


@pytest.mark.parametrize("case", OP_KWARGS_ERRORS, ids=[c[0] for c in OP_KWARGS_ERRORS])
def test_op_kwargs_errors(case):
    _, build, error, message = case
    seq = block_with_plain_module()
    x, probs = block_inputs()
    with torch.no_grad():
        expected = seq(x, SPLITS, probs, SPLITS)
    weights = [p.detach().clone() for p in seq.parameters()]
    with pytest.raises(error, match=message):
        seq(x, SPLITS, probs, SPLITS, op_kwargs=build(seq))
    with pytest.raises(error, match=message):
        seq.explain(x, SPLITS, probs, SPLITS, op_kwargs=build(seq))
    assert all(torch.equal(p, w) for p, w in zip(seq.parameters(), weights))
    assert x.grad is None
    # a valid call on the same Sequential still works and gives the same result
    buf = torch.empty(ROWS, HIDDEN)
    out = seq(x, SPLITS, probs, SPLITS, op_kwargs={-3: {fo.OUTPUT_BUFFER_KEY: buf}})
    assert torch.equal(out, expected)


@pytest.mark.parametrize("count", [0, 1, 2, 4])
def test_wrong_number_of_extra_inputs(count):
    seq = expert_block()
    x, probs = block_inputs()
    extras = [SPLITS, probs, SPLITS, probs, SPLITS][:count]
    with pytest.raises(ValueError, match=rf"expected 3 extra input\(s\) .*ScaledSwiGLU takes 1.*got {count}"):
        seq(x, *extras)
    assert seq(x, SPLITS, probs, SPLITS).shape == (ROWS, HIDDEN)
    with pytest.raises(ValueError, match="no op takes any"):
        fo.Sequential(fo.ReLU(), torch.nn.Tanh())(x, probs)


def test_extra_inputs_reach_the_right_ops_across_plain_modules():
    # plain modules get only the main tensor; extra inputs skip them and go to ops in order
    fc1 = fo.GroupedLinear(2, 4, 6, dtype=torch.float64)
    fc2 = fo.GroupedLinear(2, 3, 5, dtype=torch.float64)
    seq = fo.Sequential(fc1, torch.nn.Tanh(), fo.ScaledSwiGLU(), torch.nn.Identity(), fc2, fo.Scale())
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(7, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(7, dtype=torch.float64, requires_grad=True)
    splits1, splits2 = [3, 4], [7, 0]
    out = seq(x, splits1, probs, splits2, weights)
    h = ref.grouped_linear(x.detach(), fc1.weight.detach(), None, splits1).tanh()
    h = ref.activation("swiglu", h) * probs.detach()[:, None]
    expected = ref.grouped_linear(h, fc2.weight.detach(), None, splits2) * weights.detach()[:, None]
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(lambda x, p, w: seq(x, splits1, p, splits2, w), (x, probs, weights))
    plan = seq.explain(x, splits1, probs, splits2, weights)
    assert [g if isinstance(g, str) else len(g.op_names) for g in plan.groups] == [
        1,
        "Tanh",
        1,
        "Identity",
        2,
    ]


# ---------------------------------------------------------------- container protocol


def test_container_protocol():
    a, b, c = fo.ReLU(), fo.ConstantScale(2.0), fo.SiLU()
    seq = fo.Sequential(a, b)
    assert len(seq) == 2 and seq[0] is a and seq[-1] is b and list(seq) == [a, b]
    with pytest.raises(IndexError):
        seq[2]
    seq.append(c)
    assert list(seq) == [a, b, c]
    x = torch.randn(3, 4)
    torch.testing.assert_close(seq(x), torch.nn.functional.silu(2 * torch.relu(x)))

    d = fo.ConstantScale(-1.0)
    seq.insert(0, d)
    assert list(seq) == [d, a, b, c]
    torch.testing.assert_close(seq(x), torch.nn.functional.silu(2 * torch.relu(-x)))  # regrouped
    e, f = fo.Identity(), fo.ConstantScale(3.0)
    seq.extend([e, f])
    assert len(seq) == 6 and seq[-1] is f
    torch.testing.assert_close(seq(x), 3 * torch.nn.functional.silu(2 * torch.relu(-x)))

    sub = seq[1:3]
    assert isinstance(sub, fo.Sequential) and list(sub) == [a, b]
    torch.testing.assert_close(sub(x), 2 * torch.relu(x))
    assert sub[0] is a  # slicing shares modules (and parameters)

    del seq[0]
    assert list(seq) == [a, b, c, e, f]
    seq[1] = fo.ConstantScale(5.0)
    torch.testing.assert_close(seq(x), 3 * torch.nn.functional.silu(5 * torch.relu(x)))
    assert seq.pop() is f and len(seq) == 4
    with pytest.raises(TypeError, match="not an nn.Module"):
        seq.append(lambda t: t)


def test_op_kwargs_index_follows_insertion():
    seq = expert_block()
    x, probs = block_inputs()
    expected = seq(x, SPLITS, probs, SPLITS)
    seq.insert(0, fo.Identity())  # fc2 moves from index 2 to 3
    buf = torch.empty(ROWS, HIDDEN)
    out = seq(x, SPLITS, probs, SPLITS, op_kwargs={3: {fo.OUTPUT_BUFFER_KEY: buf}})
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, expected)
    with pytest.raises(TypeError, match="ScaledSwiGLU"):
        seq(x, SPLITS, probs, SPLITS, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: buf}})


def test_state_dict_and_module_registration():
    seq = expert_block()
    assert set(seq.state_dict()) == {"0.weight", "2.weight"}
    assert len(list(seq.parameters())) == 2
    clone = expert_block()
    clone.load_state_dict(seq.state_dict())
    x, probs = block_inputs()
    assert torch.equal(clone(x, SPLITS, probs, SPLITS), seq(x, SPLITS, probs, SPLITS))


def test_linear_composite_matches_torch_linear():
    lin = fo.Linear(5, 3, dtype=torch.float64)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert set(lin.state_dict()) == {"0.weight", "1.bias"}
    assert torch.autograd.gradcheck(lin, (x,))


# ---------------------------------------------------------------- module surgery


def _replace_by_setattr(seq, op):
    setattr(seq, "2", op)


def _replace_by_add_module(seq, op):
    seq.add_module("2", op)


def _replace_in_modules_dict(seq, op):
    seq._modules["2"] = op


def _replace_by_del_and_append(seq, op):
    del seq[2]
    seq.append(op)


def _replace_by_setitem(seq, op):
    seq[-1] = op


SURGERY = [
    _replace_by_setattr,
    _replace_by_add_module,
    _replace_in_modules_dict,
    _replace_by_del_and_append,
    _replace_by_setitem,
]


@pytest.mark.parametrize("surgery", SURGERY, ids=lambda f: f.__name__.removeprefix("_replace_"))
def test_module_surgery_takes_effect_on_the_next_call(surgery):
    seq = expert_block()
    x, probs = block_inputs()
    seq(x, SPLITS, probs, SPLITS)  # builds and caches the groups
    new_fc2 = fo.GroupedLinear(EXPERTS, FFN, HIDDEN)
    surgery(seq, new_fc2)
    assert seq[2] is new_fc2
    y = seq(x, SPLITS, probs, SPLITS)
    expected, _ = reference(seq, x, probs)
    torch.testing.assert_close(y.double(), expected)
    y.sum().backward()
    assert new_fc2.weight.grad is not None
    assert seq.explain(x, SPLITS, probs, SPLITS).fusion_plans[0].forward[0].op.basic_ops[2] is new_fc2


def test_module_surgery_to_a_plain_module_regroups():
    seq = fo.Sequential(fo.GroupedLinear(EXPERTS, HIDDEN, HIDDEN), fo.GroupedLinear(EXPERTS, HIDDEN, HIDDEN))
    x = torch.randn(ROWS, HIDDEN)
    seq(x, SPLITS, SPLITS)
    setattr(seq, "1", torch.nn.Tanh())
    with pytest.raises(ValueError, match="expected 1 extra input"):
        seq(x, SPLITS, SPLITS)
    torch.testing.assert_close(seq(x, SPLITS), torch.tanh(seq[0](x, SPLITS)))


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_takes_effect_on_the_next_call(assign):
    seq, source = expert_block(), expert_block()
    x, probs = block_inputs()
    seq(x, SPLITS, probs, SPLITS)
    seq.load_state_dict(source.state_dict(), assign=assign)
    torch.testing.assert_close(seq(x, SPLITS, probs, SPLITS), source(x, SPLITS, probs, SPLITS))


# ---------------------------------------------------------------- errors name the op index


def test_gated_width_mismatch_names_the_op_index_and_the_fix():
    seq = fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, FFN), fo.ScaledSwiGLU(), fo.GroupedLinear(EXPERTS, FFN, HIDDEN)
    )
    x, probs = block_inputs()
    message = (
        rf"GroupedLinear: input has shape \[16, 3\]; expected \[\.\.\., {FFN}\] \(op 2 of the Sequential; "
        rf"op 1 \(ScaledSwiGLU\) is a gated activation and halves the width, so the op before it must "
        rf"produce {2 * FFN} columns, not {FFN}\)"
    )
    with pytest.raises(ValueError, match=message):
        seq(x, SPLITS, probs, SPLITS)
    with pytest.raises(ValueError, match=message):
        seq.explain(x, SPLITS, probs, SPLITS)
    # a plain module in front shifts the indices: they stay those of the Sequential
    shifted = fo.Sequential(torch.nn.Identity(), *list(seq))
    with pytest.raises(ValueError, match=r"op 3 of the Sequential; op 2 \(ScaledSwiGLU\)"):
        shifted(x, SPLITS, probs, SPLITS)
    # nothing was computed or changed; fixing fc1's width makes the same call work
    assert x.grad is None and all(p.grad is None for p in seq.parameters())
    seq[0] = fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN)
    y = seq(x, SPLITS, probs, SPLITS)
    torch.testing.assert_close(y.double(), reference(seq, x, probs)[0])


# ---------------------------------------------------------------- plans speak in Sequential indices


def test_plans_and_decisions_use_the_sequentials_indices():
    seq = fo.Sequential(torch.nn.Identity(), *list(expert_block()))
    x, probs = block_inputs()
    fc1_out = torch.empty(ROWS, 2 * FFN)
    plan = seq.explain(x, SPLITS, probs, SPLITS, op_kwargs={1: {fo.OUTPUT_BUFFER_KEY: fc1_out}})
    group = plan.fusion_plans[0]
    assert group.first_index == 1
    assert [d.indices for d in group.decisions] == [(1, 2, 3)]
    text = str(plan)
    assert "ops: 1:GroupedLinear, 2:ScaledSwiGLU, 3:GroupedLinear" in text
    assert "grouped_mlp (joint) declined on ops 1..3: output buffer requested on fc1" in text
    seq(x, SPLITS, probs, SPLITS)
    assert "GroupedMLP(ops 1..3)" in str(seq.last_plan) and "fired on ops 1..3" in str(seq.last_plan)
    # a hooked op is named by its Sequential index too
    seq[2].register_forward_hook(lambda module, args, out: None)
    seq(x, SPLITS, probs, SPLITS)
    hooked = [d for d in seq.last_plan.decisions if d.rule == "module_hooks"]
    assert hooked[0].indices == (2,) and "forward hook on op 2 (ScaledSwiGLU)" in hooked[0].reason


def test_unsupported_activation_decline_names_the_supported_classes():
    seq = fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, FFN), fo.GELU(), fo.GroupedLinear(EXPERTS, FFN, HIDDEN), fo.Scale()
    )
    x, probs = block_inputs()
    (decision,) = seq.explain(x, SPLITS, SPLITS, probs).decisions
    assert not decision.fired
    assert decision.reason == (
        "activation GELU (gelu) is not supported by GroupedMLP; supported here: "
        "ClampedSwiGLU, GEGLU, SReLU, SwiGLU"
    )
