"""Caller-provided buffers (DESIGN 5): aliasing, bit-identity, padded tail, and every rejection.

Each scenario runs fused (the default: GroupedMLP) and unfused (``fo.settings(fusion=False)``),
and on a lone GroupedLinear. A rejected call must leave every buffer and parameter as it was.
"""

from __future__ import annotations

import contextlib

import pytest
import reference_ops as ref
import torch

import fusible_ops as fo

SPLITS = [5, 0, 7, 4]
ROWS, HIDDEN, FFN, EXPERTS = 16, 8, 6, 4
SENTINEL = -1234.5
MODES = ["fused", "unfused"]


def fusion(mode: str):
    return fo.settings(fusion=False) if mode == "unfused" else contextlib.nullcontext()


def expert_block(dtype=torch.float32) -> fo.Sequential:
    return fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(EXPERTS, FFN, HIDDEN, dtype=dtype),
    )


def inputs(dtype=torch.float32, shape=(ROWS, HIDDEN)):
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    probs = torch.rand(shape[:-1], dtype=dtype, requires_grad=True)
    return x, probs


def sentinel(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, SENTINEL, dtype=dtype)


def run(seq, x, probs, op_kwargs=None, grad_seed=1):
    """Forward + backward with a fixed output gradient; returns output and all grads."""
    out = seq(x, SPLITS, probs, SPLITS, op_kwargs=op_kwargs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    x.grad = probs.grad = None
    seq.zero_grad(set_to_none=True)
    out.backward(dy)
    return out, x.grad, probs.grad, seq[0].weight.grad, seq[2].weight.grad


# ---------------------------------------------------------------- accepted buffers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buffers_alias_and_are_bit_identical(mode, dtype):
    seq = expert_block(dtype)
    x, probs = inputs(dtype)
    with fusion(mode):
        expected = [t.clone() for t in run(seq, x, probs)]
        out_buf = sentinel(ROWS + 5, HIDDEN, dtype=dtype)  # padded tail of 5 rows
        grad_buf = sentinel(ROWS, HIDDEN, dtype=dtype)
        got = run(
            seq, x, probs, {2: {fo.OUTPUT_BUFFER_KEY: out_buf}, 0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}
        )
        plan = seq.last_plan.fusion_plans[0]
    assert plan.forward_op_types() == (
        ["GroupedMLP"] if mode == "fused" else ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    )
    out = got[0]
    assert out.data_ptr() == out_buf.data_ptr() and out.shape == (ROWS, HIDDEN)
    assert torch.all(out_buf[ROWS:] == SENTINEL), "the padded tail was written"
    assert torch.equal(out_buf[:ROWS], expected[0])
    assert torch.equal(grad_buf, got[1]) and torch.equal(grad_buf, expected[1])
    for name, a, b in zip(("out", "dx", "dprobs", "dw1", "dw2"), got, expected):
        assert torch.equal(a, b), f"{name} differs with buffers"


@pytest.mark.parametrize("mode", MODES)
def test_each_buffer_on_its_own(mode):
    seq = expert_block()
    x, probs = inputs()
    with fusion(mode):
        expected = [t.clone() for t in run(seq, x, probs)]
        out_buf = sentinel(ROWS, HIDDEN)
        got = run(seq, x, probs, {seq[2]: {fo.OUTPUT_BUFFER_KEY: out_buf}})
        assert got[0].data_ptr() == out_buf.data_ptr()
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

        grad_buf = sentinel(ROWS + 2, HIDDEN)
        got = run(seq, x, probs, {seq[0]: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}})
        assert grad_buf[:ROWS].data_ptr() == grad_buf.data_ptr()
        assert torch.equal(grad_buf[:ROWS], expected[1])
        assert torch.all(grad_buf[ROWS:] == SENTINEL)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("mode", MODES)
def test_buffers_reused_across_iterations(mode):
    seq = expert_block()
    out_buf, grad_buf = torch.empty(ROWS, HIDDEN), torch.empty(ROWS, HIDDEN)
    kwargs = {-1: {fo.OUTPUT_BUFFER_KEY: out_buf}, 0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}
    with fusion(mode):
        for _ in range(3):
            x, probs = inputs()
            expected = [t.clone() for t in run(seq, x, probs)]
            got = run(seq, x, probs, kwargs)
            assert got[0].data_ptr() == out_buf.data_ptr()
            assert torch.equal(out_buf, expected[0]) and torch.equal(grad_buf, expected[1])
            # the caller's buffers stay plain tensors: no grad_fn attached to them
            assert not out_buf.requires_grad and out_buf.grad_fn is None and grad_buf.grad_fn is None


@pytest.mark.parametrize("mode", MODES)
def test_batch_seq_hidden_input_with_flat_or_shaped_buffer(mode):
    seq = expert_block()
    x, probs = inputs(shape=(2, 8, HIDDEN))
    with fusion(mode):
        expected = [t.clone() for t in run(seq, x, probs)]
        flat = sentinel(ROWS + 1, HIDDEN)  # token dims flattened, with a padded row
        got = run(seq, x, probs, {2: {fo.OUTPUT_BUFFER_KEY: flat}})
        assert got[0].shape == (2, 8, HIDDEN) and got[0].data_ptr() == flat.data_ptr()
        assert torch.equal(got[0], expected[0]) and flat[ROWS, 0] == SENTINEL
        shaped = sentinel(2, 8, HIDDEN)
        got = run(seq, x, probs, {0: {fo.GRAD_INPUT_BUFFER_KEY: shaped}})
        assert torch.equal(shaped, expected[1])


def test_lone_grouped_linear_buffers():
    op = fo.GroupedLinear(EXPERTS, HIDDEN, 3, bias=True)
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    expected = op(x, SPLITS)
    expected.backward(torch.ones_like(expected))
    expected_dx = x.grad.clone()
    x.grad = None
    out_buf, grad_buf = sentinel(ROWS + 3, 3), sentinel(ROWS, HIDDEN)
    out = op(x, SPLITS, output=out_buf, grad_input=grad_buf)
    assert out.data_ptr() == out_buf.data_ptr() and torch.equal(out, expected)
    assert torch.all(out_buf[ROWS:] == SENTINEL)
    out.backward(torch.ones_like(out))
    assert torch.equal(grad_buf, expected_dx) and torch.equal(x.grad, expected_dx)


def test_zero_tokens_with_buffers():
    seq = expert_block()
    x, probs = torch.zeros(0, HIDDEN, requires_grad=True), torch.zeros(0, requires_grad=True)
    out_buf = sentinel(4, HIDDEN)
    out = seq(x, [0] * EXPERTS, probs, [0] * EXPERTS, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: out_buf}})
    assert out.shape == (0, HIDDEN)
    out.sum().backward()
    assert torch.all(out_buf == SENTINEL)
    assert torch.equal(seq[0].weight.grad, torch.zeros_like(seq[0].weight))


# ---------------------------------------------------------------- rejected buffers


BAD_BUFFERS = {
    # name: (builder(x, seq, required_shape) -> buffer, message regex)
    "too_few_rows": (lambda x, seq, shape: sentinel(shape[0] - 1, shape[1]), r"has 15 rows; at least 16"),
    "wrong_trailing_dims": (
        lambda x, seq, shape: sentinel(shape[0], shape[1] + 1),
        r"trailing dims must match",
    ),
    "wrong_rank": (lambda x, seq, shape: sentinel(shape[0], 2, shape[1]), r"trailing dims must match"),
    "wrong_dtype": (
        lambda x, seq, shape: sentinel(*shape, dtype=torch.float64),
        r"dtype torch.float64; expected torch.float32",
    ),
    "wrong_device": (lambda x, seq, shape: torch.empty(shape, device="meta"), r"is on meta; expected cpu"),
    "non_contiguous": (lambda x, seq, shape: sentinel(shape[1], shape[0]).t(), r"must be contiguous"),
    "requires_grad": (
        lambda x, seq, shape: sentinel(*shape).requires_grad_(),
        r"must not require grad; pass buf.detach\(\)",
    ),
    "overlaps_input": (
        lambda x, seq, shape: x.detach().view(-1)[: shape[0] * shape[1]].view(shape),
        r"overlaps",
    ),
    "overlaps_parameter": (
        lambda x, seq, shape: seq[0].weight.detach().view(-1)[: shape[0] * shape[1]].view(shape),
        r"overlaps",
    ),
    "not_a_tensor": (lambda x, seq, shape: [[0.0] * shape[1]] * shape[0], r"must be a torch.Tensor"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", [fo.OUTPUT_BUFFER_KEY, fo.GRAD_INPUT_BUFFER_KEY])
@pytest.mark.parametrize("bad", list(BAD_BUFFERS))
def test_bad_buffer_rejected_before_any_write(bad, key, mode):
    seq = expert_block()
    x, probs = inputs()
    build, message = BAD_BUFFERS[bad]
    buffer = build(x, seq, (ROWS, HIDDEN))
    # the other buffer is valid: it must not be written either
    good = sentinel(ROWS, HIDDEN)
    if key == fo.OUTPUT_BUFFER_KEY:
        op_kwargs = {2: {key: buffer}, 0: {fo.GRAD_INPUT_BUFFER_KEY: good}}
    else:
        op_kwargs = {0: {key: buffer}, 2: {fo.OUTPUT_BUFFER_KEY: good}}
    params_before = [p.detach().clone() for p in seq.parameters()]
    x_before = x.detach().clone()
    buffer_before = (
        buffer.detach().clone() if isinstance(buffer, torch.Tensor) and not buffer.is_meta else None
    )

    with fusion(mode):
        with pytest.raises(ValueError, match=rf"GroupedLinear: buffer '{key}' .*" + message):
            seq(x, SPLITS, probs, SPLITS, op_kwargs=op_kwargs)
        with pytest.raises(ValueError, match=message):
            seq.explain(x, SPLITS, probs, SPLITS, op_kwargs=op_kwargs)

        assert torch.all(good == SENTINEL), "a valid buffer was written by a failed call"
        if buffer_before is not None:
            assert torch.equal(buffer.detach(), buffer_before), "the rejected buffer was written"
        assert all(torch.equal(p, b) for p, b in zip(seq.parameters(), params_before))
        assert torch.equal(x.detach(), x_before) and x.grad is None and probs.grad is None
        # the same Sequential still works with valid buffers
        out = seq(x, SPLITS, probs, SPLITS, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: good}})
        assert out.data_ptr() == good.data_ptr()


def test_lone_grouped_linear_rejects_before_write():
    op = fo.GroupedLinear(EXPERTS, HIDDEN, 3)
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    good = sentinel(ROWS, 3)
    with pytest.raises(ValueError, match="grad_input"):
        op(x, SPLITS, output=good, grad_input=sentinel(ROWS, HIDDEN + 1))
    assert torch.all(good == SENTINEL)
    weight = op.weight.detach().clone()
    with pytest.raises(ValueError, match="overlaps"):
        op(x, SPLITS, output=op.weight.detach().view(-1)[: ROWS * 3].view(ROWS, 3))
    assert torch.equal(op.weight, weight)


# ---------------------------------------------------------------- validate_or_alloc_output


def test_validate_or_alloc_output_directly():
    fresh = fo.validate_or_alloc_output(None, (3, 4), torch.float32, "cpu")
    assert fresh.shape == (3, 4) and fresh.dtype == torch.float32
    buf = torch.empty(5, 4)
    view = fo.validate_or_alloc_output(buf, (3, 4), torch.float32, torch.device("cpu"))
    assert view.shape == (3, 4) and view.data_ptr() == buf.data_ptr()
    full = fo.validate_or_alloc_output(buf, (5, 4), torch.float32, "cpu")
    assert full is not buf and full.data_ptr() == buf.data_ptr()  # a view: autograd never touches buf
    with pytest.raises(ValueError, match=r"fc9: buffer 'grad_input' has 5 rows; at least 6 are needed"):
        fo.validate_or_alloc_output(buf, (6, 4), torch.float32, "cpu", op_name="fc9", key="grad_input")
    other = torch.empty(10)
    with pytest.raises(ValueError, match="overlaps"):
        fo.validate_or_alloc_output(
            other[2:].view(2, 4), (2, 4), torch.float32, "cpu", no_overlap=[other[:3]]
        )
    # adjacent but disjoint memory is fine
    fo.validate_or_alloc_output(other[2:].view(2, 4), (2, 4), torch.float32, "cpu", no_overlap=[other[:2]])


# ---------------------------------------------------------------- aliasing across a whole call


def _optimizer_with_state(module: torch.nn.Module) -> torch.optim.Optimizer:
    """An Adam over ``module`` that has taken one step (so it holds state), grads cleared."""
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def assert_refused_untouched(seq, call, buffers, message, *, explain=None, error=ValueError):
    """``call()`` raises ``error`` matching ``message``; buffers, parameters and optimizer
    state are unchanged."""
    optimizer = _optimizer_with_state(seq)
    optimizer_before = _optimizer_snapshot(optimizer)
    params_before = [p.detach().clone() for p in seq.parameters()]
    buffers_before = [b.clone() for b in buffers]
    with pytest.raises(error, match=message):
        call()
    if explain is not None:
        with pytest.raises(error, match=message):
            explain()
    for buffer, before in zip(buffers, buffers_before):
        assert torch.equal(buffer, before), "a failed call wrote a buffer"
    for p, before in zip(seq.parameters(), params_before):
        assert torch.equal(p.detach(), before), "a failed call changed a parameter"
        assert p.grad is None
    after = _optimizer_snapshot(optimizer)
    assert len(after) == len(optimizer_before)
    assert all(torch.equal(a, b) for a, b in zip(after, optimizer_before)), "optimizer state changed"


def square_block() -> fo.Sequential:
    """Two GroupedLinear ops whose outputs and input gradients all have the same shape."""
    return fo.Sequential(fo.GroupedLinear(EXPERTS, HIDDEN, HIDDEN), fo.GroupedLinear(EXPERTS, HIDDEN, HIDDEN))


SHARED_BUFFER_CASES = {
    "same_output_twice": lambda buf: {
        0: {fo.OUTPUT_BUFFER_KEY: buf[:ROWS]},
        1: {fo.OUTPUT_BUFFER_KEY: buf[:ROWS]},
    },
    "same_grad_input_twice": lambda buf: {
        0: {fo.GRAD_INPUT_BUFFER_KEY: buf[:ROWS]},
        1: {fo.GRAD_INPUT_BUFFER_KEY: buf[:ROWS]},
    },
    "output_is_other_grad_input": lambda buf: {
        0: {fo.GRAD_INPUT_BUFFER_KEY: buf[:ROWS]},
        1: {fo.OUTPUT_BUFFER_KEY: buf[:ROWS]},
    },
    "one_op_output_and_grad_input": lambda buf: {
        1: {fo.OUTPUT_BUFFER_KEY: buf[:ROWS], fo.GRAD_INPUT_BUFFER_KEY: buf[:ROWS]}
    },
    "partial_overlap": lambda buf: {
        0: {fo.OUTPUT_BUFFER_KEY: buf[:ROWS]},
        1: {fo.OUTPUT_BUFFER_KEY: buf[10 : 10 + ROWS]},
    },
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(SHARED_BUFFER_CASES))
def test_one_memory_given_as_two_buffers_is_refused(case, mode):
    seq = square_block()
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    buf = sentinel(2 * ROWS, HIDDEN)
    op_kwargs = SHARED_BUFFER_CASES[case](buf)
    with fusion(mode):
        assert_refused_untouched(
            seq,
            lambda: seq(x, SPLITS, SPLITS, op_kwargs=op_kwargs),
            [buf],
            r"GroupedLinear: buffer '\w+' \(op \d\) overlaps GroupedLinear: buffer '\w+' \(op \d\)",
            explain=lambda: seq.explain(x, SPLITS, SPLITS, op_kwargs=op_kwargs),
        )
        assert x.grad is None
        # the same objects work with separate buffers, and match the unbuffered call
        expected = seq(x, SPLITS, SPLITS)
        out_buf, grad_buf = torch.empty(ROWS, HIDDEN), torch.empty(ROWS, HIDDEN)
        got = seq(
            x,
            SPLITS,
            SPLITS,
            op_kwargs={1: {fo.OUTPUT_BUFFER_KEY: out_buf}, 0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}},
        )
        assert torch.equal(got, expected) and got.data_ptr() == out_buf.data_ptr()


def test_lone_op_given_one_tensor_as_output_and_grad_input_is_refused():
    op = fo.GroupedLinear(EXPERTS, HIDDEN, HIDDEN)
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    buf = sentinel(ROWS, HIDDEN)
    with pytest.raises(
        ValueError, match=r"buffer 'grad_input' \(op 0\) overlaps GroupedLinear: buffer 'output'"
    ):
        op(x, SPLITS, output=buf, grad_input=buf)
    assert torch.all(buf == SENTINEL)


def cross_group_block() -> fo.Sequential:
    """Two fuser groups separated by a plain module."""
    return fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, HIDDEN), torch.nn.Tanh(), fo.GroupedLinear(EXPERTS, HIDDEN, HIDDEN)
    )


CROSS_GROUP_CASES = {
    # the buffer of op 2 overlaps something only the first group (or the caller) sees
    "output_over_first_group_weight": lambda seq, x: {
        2: {fo.OUTPUT_BUFFER_KEY: seq[0].weight.detach().view(-1)[: ROWS * HIDDEN].view(ROWS, HIDDEN)}
    },
    "grad_input_over_sequential_input": lambda seq, x: {2: {fo.GRAD_INPUT_BUFFER_KEY: x.detach()}},
    "output_over_sequential_input": lambda seq, x: {2: {fo.OUTPUT_BUFFER_KEY: x.detach()}},
}


@pytest.mark.parametrize("case", list(CROSS_GROUP_CASES))
def test_buffer_overlapping_another_groups_tensors_is_refused(case):
    seq = cross_group_block()
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    op_kwargs = CROSS_GROUP_CASES[case](seq, x)
    x_before = x.detach().clone()
    assert_refused_untouched(
        seq,
        lambda: seq(x, SPLITS, SPLITS, op_kwargs=op_kwargs),
        [],
        r"GroupedLinear: buffer '\w+' \(op 2\) overlaps the memory of an input, extra input, parameter",
        explain=lambda: seq.explain(x, SPLITS, SPLITS, op_kwargs=op_kwargs),
    )
    assert torch.equal(x.detach(), x_before)
    seq(x, SPLITS, SPLITS, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: torch.empty(ROWS, HIDDEN)}}).sum().backward()


def test_direct_calls_sharing_a_grad_input_buffer_never_corrupt_gradients():
    op1, op2 = fo.GroupedLinear(EXPERTS, HIDDEN, 3), fo.GroupedLinear(EXPERTS, HIDDEN, 3)
    x1 = torch.randn(ROWS, HIDDEN, requires_grad=True)
    x2 = torch.randn(ROWS, HIDDEN, requires_grad=True)
    shared = sentinel(ROWS, HIDDEN)
    y1 = op1(x1, SPLITS, grad_input=shared)
    y2 = op2(x2, SPLITS, grad_input=shared)
    y2.sum().backward()  # writes `shared`, which autograd keeps as x2.grad
    x2_grad = x2.grad.clone()
    with pytest.raises(
        RuntimeError, match=r"op 0 \(GroupedLinear\): its grad_input buffer was written by another call"
    ):
        y1.sum().backward()  # would overwrite x2.grad
    assert torch.equal(x2.grad, x2_grad) and x1.grad is None
    # one backward over both: whichever runs second refuses, nothing wrong is left behind
    x1.grad = x2.grad = None
    op1.zero_grad(), op2.zero_grad()
    y1 = op1(x1, SPLITS, grad_input=shared)
    y2 = op2(x2, SPLITS, grad_input=shared)
    with pytest.raises(RuntimeError, match="grad_input buffer was written by another call"):
        (y1.sum() + y2.sum()).backward()
    # separate buffers: both gradients right
    b1, b2 = torch.empty(ROWS, HIDDEN), torch.empty(ROWS, HIDDEN)
    x1.grad = x2.grad = None
    (op1(x1, SPLITS, grad_input=b1).sum() + op2(x2, SPLITS, grad_input=b2).sum()).backward()
    for op, x in ((op1, x1), (op2, x2)):
        ref_x = x.detach().double().requires_grad_()
        rows = torch.split(ref_x, SPLITS)
        expected = torch.cat([r @ w.double().T for r, w in zip(rows, op.weight.detach())])
        expected.sum().backward()
        torch.testing.assert_close(x.grad.double(), ref_x.grad)


@pytest.mark.parametrize("mode", MODES)
def test_grad_input_buffer_adopted_as_leaf_grad_accumulates_correctly(mode):
    """After one backward, autograd keeps the buffer as x.grad; more backwards must add to it."""
    seq = expert_block()
    x, probs = inputs()
    grad_buf = sentinel(ROWS, HIDDEN)
    with fusion(mode):
        seq(x, SPLITS, probs, SPLITS).sum().backward()
        one = x.grad.clone()
        x.grad = None
        # the single-step gradient itself against the plain-PyTorch float64 reference
        x_ref = ref.leaf(x)
        ref.expert_block(
            x_ref, ref.leaf(seq[0].weight), ref.leaf(probs), ref.leaf(seq[2].weight), SPLITS
        ).sum().backward()
        torch.testing.assert_close(one.double(), x_ref.grad)
        for step in range(1, 4):
            seq(
                x, SPLITS, probs, SPLITS, op_kwargs={0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}
            ).sum().backward()
            torch.testing.assert_close(x.grad, step * one)
        assert x.grad.data_ptr() == grad_buf.data_ptr()  # it really is the buffer
        # zeroing in place (zero_grad(set_to_none=False)) between steps: one gradient again
        x.grad.zero_()
        seq(x, SPLITS, probs, SPLITS, op_kwargs={0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}).sum().backward()
        torch.testing.assert_close(x.grad, one)
        # a leaf viewed before the call: its .grad is adopted through the view's backward
        base = x.detach().clone().requires_grad_()
        for step in range(1, 3):
            view = base.view(ROWS, HIDDEN)
            seq(
                view, SPLITS, probs, SPLITS, op_kwargs={0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}
            ).sum().backward()
            torch.testing.assert_close(base.grad, step * one)


def test_buffer_made_under_inference_mode_is_refused_for_training():
    seq = expert_block()
    x, probs = inputs()
    with torch.inference_mode():
        out_buf = torch.full((ROWS, HIDDEN), SENTINEL)
        x_inference = x.detach().clone()
    assert_refused_untouched(
        seq,
        lambda: seq(x, SPLITS, probs, SPLITS, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: out_buf}}),
        [out_buf],
        r"GroupedLinear: buffer 'output' was created under torch.inference_mode",
    )
    assert_refused_untouched(
        seq,
        lambda: seq(x_inference, SPLITS, probs, SPLITS),
        [],
        r"op 0 \(GroupedLinear\): input .* was created under torch.inference_mode .* torch.no_grad\(\)",
    )
    # inside inference_mode the same buffer and input are fine
    with torch.inference_mode():
        out = seq(x_inference, SPLITS, probs.detach(), SPLITS, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: out_buf}})
    assert out.data_ptr() == out_buf.data_ptr()
    torch.testing.assert_close(out_buf, seq(x, SPLITS, probs, SPLITS).detach())


# ---------------------------------------------------------------- property: any mix of buffers over a Sequential

from hypothesis import event, given  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

P_SPLITS, P_ROWS, P_HIDDEN, P_FFN = [2, 0, 3, 1], 6, 4, 3
#: (op index, key, columns) of every buffer the expert block accepts
P_SLOTS = [
    (0, fo.OUTPUT_BUFFER_KEY, 2 * P_FFN),
    (0, fo.GRAD_INPUT_BUFFER_KEY, P_HIDDEN),
    (2, fo.OUTPUT_BUFFER_KEY, P_HIDDEN),
    (2, fo.GRAD_INPUT_BUFFER_KEY, P_FFN),
]
P_ARENA = 1024

_slot_choice = st.one_of(
    st.none(),
    st.none(),
    st.tuples(st.just("disjoint"), st.just(0), st.integers(P_ROWS, P_ROWS + 2)),
    st.tuples(st.just("disjoint"), st.just(0), st.integers(P_ROWS, P_ROWS + 2)),
    st.tuples(st.just("arena"), st.integers(0, 160), st.integers(P_ROWS - 1, P_ROWS + 2)),
    st.tuples(st.just("disjoint"), st.just(0), st.integers(P_ROWS - 1, P_ROWS + 2)),
    st.tuples(st.sampled_from(["input", "weight", "probs"]), st.just(0), st.just(P_ROWS)),
)


def _place(choice, slot_index, cols, arena, x, probs, seq):
    """The buffer for ``choice`` and, for arena buffers, its element span ``(start, end)``."""
    source, offset, rows = choice
    if source == "disjoint":
        offset = 300 + 150 * slot_index
    if source in ("arena", "disjoint"):
        return arena[offset : offset + rows * cols].view(rows, cols), (offset, offset + rows * cols)
    backing = {"input": x, "weight": seq[0].weight, "probs": probs}[source].detach().view(-1)
    rows = min(rows, backing.numel() // cols)
    return backing[: rows * cols].view(rows, cols), None


@hypothesis_settings(max_examples=120, deadline=None)
@given(choices=st.lists(_slot_choice, min_size=4, max_size=4), fused=st.booleans())
def test_any_buffers_over_a_sequential_are_bit_identical_or_refused_untouched(choices, fused):
    torch.manual_seed(0)
    seq = fo.Sequential(
        fo.GroupedLinear(EXPERTS, P_HIDDEN, 2 * P_FFN),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(EXPERTS, P_FFN, P_HIDDEN),
    )
    x = torch.randn(P_ROWS, P_HIDDEN, requires_grad=True)
    probs = torch.rand(P_ROWS, requires_grad=True)
    dy = torch.randn(P_ROWS, P_HIDDEN)
    mode = "fused" if fused else "unfused"

    def run_once(op_kwargs):
        x.grad = probs.grad = None
        seq.zero_grad(set_to_none=True)
        out = seq(x, P_SPLITS, probs, P_SPLITS, op_kwargs=op_kwargs)
        out.backward(dy)
        return [
            out.detach().clone(),
            x.grad.clone(),
            probs.grad.clone(),
            seq[0].weight.grad.clone(),
            seq[2].weight.grad.clone(),
        ]

    # a buffer may make the fused op decline (the plan says why): the unbuffered result
    # to match bit for bit is the one computed by the same ops
    with fusion("unfused"):
        expected_unfused = run_once(None)
    with fusion(mode):
        expected_fused = run_once(None)
        arena = torch.full((P_ARENA,), SENTINEL)
        op_kwargs: dict[int, dict] = {}
        spans, valid = [], True
        for slot_index, (choice, (op_index, key, cols)) in enumerate(zip(choices, P_SLOTS)):
            if choice is None:
                continue
            buffer, span = _place(choice, slot_index, cols, arena, x, probs, seq)
            op_kwargs.setdefault(op_index, {})[key] = buffer
            valid &= span is not None and buffer.shape[0] >= P_ROWS  # over a call's tensor: refused
            if span is not None:
                valid &= all(span[1] <= start or end <= span[0] for start, end, _ in spans)
                spans.append((*span, cols))
        arena_before = arena.clone()
        tensors_before = [t.detach().clone() for t in (x, probs, *seq.parameters())]
        event("refused" if not valid else "accepted")
        if not valid:
            with pytest.raises(ValueError, match=r"GroupedLinear: buffer"):
                run_once(op_kwargs)
            assert torch.equal(arena, arena_before), "a refused call wrote a buffer"
            after = [t.detach() for t in (x, probs, *seq.parameters())]
            assert all(torch.equal(a, b) for a, b in zip(after, tensors_before))
            assert all(p.grad is None for p in seq.parameters())
            return
        got = run_once(op_kwargs)
        plan = seq.last_plan.fusion_plans[0]
        ran_fused = plan.forward_op_types() == ["GroupedMLP"]
        assert ran_fused == (plan.backward_op_types() == ["GroupedMLP"])
        assert fused or not ran_fused
        expected = expected_fused if ran_fused else expected_unfused
        for name, a, b in zip(("out", "dx", "dprobs", "dw1", "dw2"), got, expected):
            assert torch.equal(a, b), f"{name} differs with buffers {choices}"
        written = torch.zeros(P_ARENA, dtype=torch.bool)
        for start, _, cols in spans:
            written[start : start + P_ROWS * cols] = True  # only the first rows; the tail never
        assert torch.equal(arena[~written], arena_before[~written]), "memory outside the results was written"
