"""Routing helpers and the single-process MoE layer against a per-token reference loop."""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch
from error_model import rounding_rtol
from hypothesis import given, settings
from hypothesis import strategies as st

from fusible_ops.moe import permute, topk_route, unpermute

# ---------------------------------------------------------------- independent references


def _ref_route(logits_row: torch.Tensor, top_k: int, score: str, renormalize: bool):
    """(expert ids, weights) for one token, by plain Python sorting."""
    if score == "softmax":
        m = logits_row.max()
        e = torch.exp(logits_row - m)
        scores = e / e.sum()
    else:
        scores = 1.0 / (1.0 + torch.exp(-logits_row))
    chosen = sorted(range(len(scores)), key=lambda i: -float(scores[i].detach()))[:top_k]
    weights = torch.stack([scores[i] for i in chosen])
    if renormalize:
        weights = weights / weights.sum()
    return chosen, weights


def _ref_moe(x, router_w, w1, b1, w2, b2, top_k, score, renormalize, activation):
    """y[t] = sum over chosen e of (p_e * act(W1_e x + b1_e)) W2_e^T + b2_e, one token at a time."""
    outs = []
    for t in range(x.shape[0]):
        chosen, weights = _ref_route(router_w @ x[t], top_k, score, renormalize)
        y = torch.zeros(w2.shape[1], dtype=x.dtype)
        for e, p in zip(chosen, weights):
            h = w1[e] @ x[t] + (b1[e] if b1 is not None else 0)
            y = y + w2[e] @ (p * ref.activation(activation, h)) + (b2[e] if b2 is not None else 0)
        outs.append(y)
    return torch.stack(outs) if outs else x.new_zeros(0, w2.shape[1])


# ---------------------------------------------------------------- routing helpers


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_route_matches_reference(score, renormalize):
    torch.manual_seed(0)
    logits = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    probs, ids = topk_route(logits, 3, score=score, renormalize=renormalize)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = [_ref_route(ref_logits[t], 3, score, renormalize) for t in range(7)]
    assert ids.tolist() == [c for c, _ in ref]
    ref_probs = torch.stack([w for _, w in ref])
    torch.testing.assert_close(probs, ref_probs)
    grad = torch.randn_like(probs)
    probs.backward(grad)
    ref_probs.backward(grad)
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_topk_route_low_precision_logits_give_float32_probs():
    probs, ids = topk_route(torch.randn(4, 8, dtype=torch.bfloat16), 2)
    assert probs.dtype == torch.float32 and ids.dtype == torch.int64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"logits": torch.randn(4), "top_k": 1}, "2-D"),
        ({"logits": torch.randn(4, 3), "top_k": 4}, "top_k"),
        ({"logits": torch.randn(4, 3), "top_k": 0}, "top_k"),
        ({"logits": torch.randn(4, 3), "top_k": 1, "score": "relu"}, "score"),
        ({"logits": torch.ones(4, 3, dtype=torch.long), "top_k": 1}, "floating"),
    ],
)
def test_topk_route_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        topk_route(**kwargs)


def _ref_permute(tokens, ids, num_experts):
    """Rows expert by expert, tokens in order within an expert."""
    rows, sources = [], []
    for e in range(num_experts):
        for t in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                if int(ids[t, j]) == e:
                    rows.append(tokens[t])
                    sources.append((t, j))
    return rows, sources


@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_permute_unpermute_match_reference(num_tokens):
    torch.manual_seed(1)
    num_experts, top_k, hidden = 5, 2, 3
    tokens = torch.randn(hidden, num_tokens, dtype=torch.float64).t().requires_grad_()  # non-contiguous
    ids = torch.argsort(torch.rand(num_tokens, num_experts - 1), dim=1)[:, :top_k]  # distinct, never the last
    probs = torch.rand(num_tokens, top_k, dtype=torch.float64, requires_grad=True)
    perm = permute(tokens, ids, num_experts, probs)

    ref_rows, sources = _ref_permute(tokens.detach(), ids, num_experts)
    assert perm.split_sizes.tolist() == [int((ids == e).sum()) for e in range(num_experts)]
    assert perm.split_sizes[-1] == 0  # the last expert is never chosen
    assert perm.rows.shape == (num_tokens * top_k, hidden)
    if ref_rows:
        torch.testing.assert_close(perm.rows, torch.stack(ref_rows))
        torch.testing.assert_close(perm.probs, torch.stack([probs[t, j] for t, j in sources]).detach())
    assert perm.token_index.tolist() == [t for t, _ in sources]

    # combine, weighted, against a direct sum
    expert_out = torch.randn(num_tokens * top_k, hidden, dtype=torch.float64, requires_grad=True)
    out = unpermute(expert_out, perm.token_index, num_tokens, probs=perm.probs)
    ref = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for i, (t, j) in enumerate(sources):
        ref[t] += expert_out[i].detach() * probs[t, j].detach()
    torch.testing.assert_close(out, ref)

    grad = torch.randn(num_tokens, hidden, dtype=torch.float64)
    (out * grad).sum().backward()
    ref_grad_rows = torch.stack([grad[t] * probs[t, j] for t, j in sources]) if sources else expert_out.grad
    torch.testing.assert_close(expert_out.grad, ref_grad_rows.detach())
    ref_grad_probs = torch.zeros_like(probs)
    for i, (t, j) in enumerate(sources):
        ref_grad_probs[t, j] = (grad[t] * expert_out[i].detach()).sum()
    torch.testing.assert_close(probs.grad, ref_grad_probs)


def test_permute_gradient_reaches_tokens():
    torch.manual_seed(2)
    tokens = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0]])
    perm = permute(tokens, ids, 3)
    out = unpermute(perm.rows * 2.0, perm.token_index, 4)
    torch.testing.assert_close(out, tokens.detach() * 4.0)
    out.sum().backward()
    torch.testing.assert_close(tokens.grad, torch.full_like(tokens, 4.0))


@settings(max_examples=30, deadline=None)
@given(
    num_tokens=st.integers(0, 12),
    num_experts=st.integers(1, 6),
    data=st.data(),
)
def test_permute_then_unpermute_is_k_times_identity(num_tokens, num_experts, data):
    """Property: combining the permuted rows with weights 1 gives top_k * tokens; splits sum to T*k."""
    top_k = data.draw(st.integers(1, num_experts))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(num_tokens, 3, dtype=torch.float64, generator=gen)
    ids = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)[:, :top_k]
    perm = permute(tokens, ids, num_experts)
    assert int(perm.split_sizes.sum()) == num_tokens * top_k
    assert perm.split_sizes.tolist() == [int((ids == e).sum()) for e in range(num_experts)]
    # rows come out grouped by expert, in non-decreasing expert order
    row_experts = torch.repeat_interleave(torch.arange(num_experts), perm.split_sizes)
    assert torch.equal(
        ids[perm.token_index].eq(row_experts[:, None]).any(1), torch.ones(len(row_experts), dtype=torch.bool)
    )
    torch.testing.assert_close(unpermute(perm.rows, perm.token_index, num_tokens), tokens * top_k)


def test_permute_expert_order():
    tokens = torch.arange(4, dtype=torch.float64).reshape(4, 1)
    ids = torch.tensor([[0], [1], [2], [1]])
    perm = permute(tokens, ids, 3, expert_order=torch.tensor([2, 0, 1]))
    assert perm.rows.flatten().tolist() == [2.0, 0.0, 1.0, 3.0]
    assert perm.split_sizes.tolist() == [1, 1, 2]


def test_unpermute_writes_into_caller_buffer():
    rows = torch.randn(6, 4, requires_grad=True)
    token_index = torch.tensor([0, 1, 2, 0, 1, 2])
    buf = torch.full((5, 4), 7.0)  # a padded tail of 2 rows
    out = unpermute(rows, token_index, 3, out=buf)
    assert out.data_ptr() == buf.data_ptr() and out.shape == (3, 4)
    torch.testing.assert_close(out, rows.detach()[:3] + rows.detach()[3:])
    assert (buf[3:] == 7.0).all()  # tail untouched
    assert not buf.requires_grad and buf.grad_fn is None
    out.sum().backward()
    torch.testing.assert_close(rows.grad, torch.ones_like(rows))
    # bit-identical to the unbuffered call
    assert torch.equal(unpermute(rows, token_index, 3), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("with_buffer", [False, True])
def test_unpermute_without_grad_equals_the_autograd_path(dtype, with_buffer):
    """With nothing to differentiate, unpermute skips its autograd Function: the result is
    bit-identical to the differentiable call's (dropped rows, a caller buffer's tail kept)."""
    torch.manual_seed(3)
    rows = torch.randn(8, 4, dtype=dtype)
    probs = torch.rand(8, dtype=dtype)
    token_index = torch.tensor([0, -1, 2, 0, 1, -1, 2, 4])  # -1: dropped rows; token 3 gets none

    def call(rows: torch.Tensor) -> torch.Tensor:
        buf = torch.full((7, 4), 7.0, dtype=dtype) if with_buffer else None
        out = unpermute(rows, token_index, 5, probs=probs, out=buf)
        if buf is not None:
            assert out.data_ptr() == buf.data_ptr() and (buf[5:] == 7.0).all()
        return out

    differentiable = call(rows.clone().requires_grad_())
    assert differentiable.grad_fn is not None
    with torch.no_grad():
        plain = call(rows)
    assert plain.grad_fn is None
    assert torch.equal(plain, differentiable.detach())
    assert torch.equal(call(rows), plain)  # grad enabled, but no input needs a gradient


def test_unpermute_bfloat16_accumulates_in_float32():
    rows = torch.full((8, 2), 1.0 / 3.0, dtype=torch.bfloat16)
    out = unpermute(rows, torch.zeros(8, dtype=torch.long), 1)
    expected = (rows.float().sum(0, keepdim=True)).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: permute(torch.randn(3, 2), torch.zeros(2, 1, dtype=torch.long), 2), "rows"),
        (lambda: permute(torch.randn(3, 2), torch.zeros(3, 1), 2), "integer"),
        (lambda: permute(torch.randn(3, 2), torch.full((3, 1), -1), 2), r"must be >= 0.*got -1"),
        (
            lambda: permute(
                torch.randn(3, 2), torch.zeros(3, 1, dtype=torch.long), 2, dropped=torch.ones(3, 1)
            ),
            "bool",
        ),
        (
            lambda: unpermute(torch.randn(3, 2), torch.tensor([0, -2, 0]), 1),
            r"got values in \[-2, 0\] \(-1 marks a dropped row\)",
        ),
        (
            lambda: permute(torch.randn(3, 2), torch.zeros(3, 1, dtype=torch.long), 2, torch.ones(3, 2)),
            "probs",
        ),
        (lambda: unpermute(torch.randn(3, 2), torch.zeros(2, dtype=torch.long), 1), "token_index"),
        (
            lambda: unpermute(torch.randn(3, 2), torch.zeros(3, dtype=torch.long), 1, out=torch.empty(1, 3)),
            "shape",
        ),
        (
            lambda: unpermute(
                torch.randn(3, 2),
                torch.zeros(3, dtype=torch.long),
                1,
                out=torch.empty(1, 2, requires_grad=True),
            ),
            "detach",
        ),
    ],
)
def test_helpers_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_unpermute_failed_call_leaves_buffer_unchanged():
    buf = torch.full((2, 3), 5.0)
    with pytest.raises(ValueError):
        unpermute(torch.randn(3, 2), torch.zeros(3, dtype=torch.long), 2, out=buf)
    assert (buf == 5.0).all()


# ---------------------------------------------------------------- no silent wrong results


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_topk_route_sigmoid_underflow_gives_equal_weights_not_nan(dtype):
    logits = torch.randn(4, 5, dtype=torch.float64).to(dtype)
    logits[1] = -1e4  # every sigmoid score of token 1 underflows to exactly 0
    logits = logits.requires_grad_()
    probs, ids = topk_route(logits, 2, score="sigmoid", renormalize=True)
    assert not probs.isnan().any()
    torch.testing.assert_close(probs[1], torch.full((2,), 0.5, dtype=probs.dtype))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=probs.dtype))
    # the other tokens are renormalised as before
    scores = torch.sigmoid(logits.detach()[[0, 2, 3]].to(probs.dtype))
    chosen = scores.gather(1, ids[[0, 2, 3]])
    torch.testing.assert_close(probs.detach()[[0, 2, 3]], chosen / chosen.sum(-1, keepdim=True))
    probs.sum().backward()
    assert not logits.grad.isnan().any()


def test_topk_route_sigmoid_underflow_under_compile_matches_eager():
    logits = torch.full((3, 5), -1e4)
    logits[0] = torch.randn(5)

    def fn(logits):
        return topk_route(logits, 2, score="sigmoid", renormalize=True)

    eager, compiled = fn(logits), _compiled(fn)(logits)
    assert all(torch.equal(e, c) for e, c in zip(eager, compiled))
    assert not eager[0].isnan().any()


@pytest.mark.parametrize(
    "order, match",
    [
        (torch.tensor([0, 0, 1]), "permutation"),  # a duplicate leaves expert 2 without a slot
        (torch.tensor([0, 1, 3]), "permutation"),
        (torch.tensor([-1, 0, 1]), "permutation"),
        (torch.tensor([2.0, 0.0, 1.0]), "integer"),
        (torch.tensor([True, False, True]), "integer"),
        (torch.tensor([0, 1]), r"shape \(3,\)"),
        ([2, 0, 1], "tensor"),
    ],
)
def test_permute_rejects_an_expert_order_that_is_not_a_permutation(order, match):
    tokens = torch.arange(4, dtype=torch.float64).reshape(4, 1)
    ids = torch.tensor([[0], [1], [2], [1]])
    originals = (tokens.clone(), ids.clone(), order.clone() if isinstance(order, torch.Tensor) else order)
    with pytest.raises(ValueError, match=rf"permute: expert_order .*{match}"):
        permute(tokens, ids, 3, expert_order=order)
    assert torch.equal(tokens, originals[0]) and torch.equal(ids, originals[1])
    if isinstance(order, torch.Tensor):
        assert torch.equal(order, originals[2])
    # the next valid call on the same tensors works
    perm = permute(tokens, ids, 3, expert_order=torch.tensor([2, 0, 1]))
    assert perm.rows.flatten().tolist() == [2.0, 0.0, 1.0, 3.0]


def test_permute_expert_order_other_integer_dtypes():
    tokens = torch.arange(4, dtype=torch.float64).reshape(4, 1)
    ids = torch.tensor([[0], [1], [2], [1]], dtype=torch.int32)
    perm = permute(tokens, ids, 3, expert_order=torch.tensor([2, 0, 1], dtype=torch.uint8))
    assert perm.rows.flatten().tolist() == [2.0, 0.0, 1.0, 3.0]
    assert perm.split_sizes.tolist() == [1, 1, 2]


def test_permute_bad_expert_order_fails_in_the_graph():
    tokens, ids = torch.randn(3, 2), torch.tensor([[0], [2], [1]])
    fn = _compiled(lambda tokens, ids, order: permute(tokens, ids, 3, expert_order=order).rows)
    with pytest.raises(RuntimeError, match=r"expert_order must be a permutation of range\(3\)"):
        fn(tokens, ids, torch.tensor([0, 0, 1]))
    torch.testing.assert_close(fn(tokens, ids, torch.tensor([1, 2, 0])), tokens[[2, 1, 0]])


@pytest.mark.parametrize(
    "token_index, num_tokens, match",
    [
        (torch.tensor([0, 1, 3]), 3, r"\[0, num_tokens=3\), got values in \[0, 3\]"),
        (torch.tensor([0, -2, 2]), 3, r"got values in \[-2, 2\]"),
        (torch.tensor([0, 1, 2]), 2, r"num_tokens=2"),  # too-small num_tokens
        (torch.tensor([0, 1, 2]), 0, r"num_tokens=0"),
        (torch.tensor([0.0, 1.0, 2.0]), 3, "integer"),
    ],
)
def test_unpermute_bad_token_index_raises_before_touching_out(token_index, num_tokens, match):
    rows, probs = torch.randn(3, 2), torch.rand(3)
    buf = torch.full((4, 2), 5.0)
    originals = (rows.clone(), probs.clone(), token_index.clone())
    with pytest.raises(ValueError, match=rf"unpermute: token_index .*{match}"):
        unpermute(rows, token_index, num_tokens, probs=probs, out=buf)
    assert (buf == 5.0).all()
    assert torch.equal(rows, originals[0]) and torch.equal(probs, originals[1])
    assert torch.equal(token_index, originals[2])
    # the next valid call on the same buffer works
    out = unpermute(rows, torch.tensor([0, 1, 0]), 2, probs=probs, out=buf)
    torch.testing.assert_close(
        out, torch.stack([rows[0] * probs[0] + rows[2] * probs[2], rows[1] * probs[1]])
    )
    assert (buf[2:] == 5.0).all()


def test_unpermute_out_of_range_token_index_fails_in_the_graph():
    rows = torch.randn(3, 2)
    buf = torch.full((4, 2), 5.0)
    fn = _compiled(lambda rows, index, buf: unpermute(rows, index, 3, out=buf))
    with pytest.raises(RuntimeError, match=r"token_index must lie in \[0, num_tokens\)"):
        fn(rows, torch.tensor([0, 1, 3]), buf)
    assert (buf == 5.0).all()
    out = fn(rows, torch.tensor([0, 1, 2]), buf)
    assert torch.equal(out, rows) and (buf[3] == 5.0).all()


# ---------------------------------------------------------------- MoE layer

import fusible_ops as fo  # noqa: E402
from fusible_ops import MoE  # noqa: E402


def _moe_reference_check(moe, x, activation, score, renormalize, atol=1e-10):
    x = x.clone().requires_grad_()
    out = moe(x)
    assert out.shape == x.shape
    grad = torch.randn_like(out)
    out.backward(grad)

    fc1, fc2 = moe.experts[0], moe.experts[2]
    params = [moe.router.weight, fc1.weight, fc2.weight]
    params += [fc1.bias, fc2.bias] if fc1.bias is not None else []
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref_x = x.detach().clone().requires_grad_()
    rw, w1, w2, *biases = ref_params
    b1, b2 = biases if biases else (None, None)
    flat = ref_x.reshape(-1, x.shape[-1])
    ref = _ref_moe(flat, rw, w1, b1, w2, b2, moe.top_k, score, renormalize, activation).reshape(x.shape)
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-9)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, atol=atol, rtol=1e-9)
    for p, r in zip(params, ref_params):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, r.grad, atol=atol, rtol=1e-9)


@pytest.mark.parametrize(
    "activation, bias, score, renormalize",
    [
        ("swiglu", False, "softmax", True),
        ("swiglu", True, "sigmoid", True),
        ("geglu", False, "softmax", False),
        ("srelu", True, "sigmoid", False),
    ],
)
def test_moe_matches_per_token_reference(activation, bias, score, renormalize):
    torch.manual_seed(3)
    moe = MoE(
        6,
        5,
        8,
        2,
        activation=activation,
        bias=bias,
        score=score,
        renormalize=renormalize,
        dtype=torch.float64,
    )
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, 3, 6, dtype=torch.float64)  # 6 tokens * 2 < 2 * 8: some experts get none
    _moe_reference_check(moe, x, activation, score, renormalize)


def test_moe_expert_with_no_token_gets_zero_grad():
    torch.manual_seed(4)
    moe = MoE(4, 3, 4, 1, dtype=torch.float64)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[1, 0] = 10.0  # every token with x[0] > 0 goes to expert 1, others to 0
    x = torch.rand(5, 4, dtype=torch.float64) + 0.1
    _moe_reference_check(moe, x, "swiglu", "softmax", True)
    for name in ("weight",):
        grad = getattr(moe.experts[0], name).grad
        assert torch.count_nonzero(grad[2:]) == 0 and torch.count_nonzero(grad[1]) > 0


def test_moe_unfused_and_non_contiguous_input():
    torch.manual_seed(6)
    moe = MoE(6, 4, 5, 2, bias=True, dtype=torch.float64)
    x = torch.randn(6, 7, dtype=torch.float64).t()  # [7, 6], non-contiguous
    with fo.settings(fusion=False):
        _moe_reference_check(moe, x, "swiglu", "softmax", True)
    fused = moe(x)
    with fo.settings(fusion=False):
        torch.testing.assert_close(moe(x), fused)


def test_moe_zero_tokens():
    moe = MoE(4, 3, 4, 2, dtype=torch.float64)
    x = torch.zeros(0, 4, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    assert out.shape == (0, 4)
    out.sum().backward()
    assert moe.experts[0].weight.grad is not None and torch.count_nonzero(moe.experts[0].weight.grad) == 0
    assert moe.router.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_low_precision_close_to_float64(dtype):
    torch.manual_seed(5)
    moe = MoE(8, 6, 4, 2, dtype=dtype)
    ref = MoE(8, 6, 4, 2, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in moe.state_dict().items()})
    x = torch.randn(5, 8, dtype=dtype)
    out = moe(x)
    assert out.dtype == dtype
    # float32: router (8), softmax (4), fc1 (8), fc2 (6), top-2 combine; bf16: the rounded
    # logits, fc1, activation, fc2 and combine results (the seeded data keep the top-k
    # choice away from ties, which no tolerance covers)
    tol = {
        torch.float32: rounding_rtol(torch.float32, 8 + 4 + 8 + 6 + 2, condition=4),
        torch.bfloat16: rounding_rtol(torch.bfloat16, 5, condition=2),
    }[dtype]
    torch.testing.assert_close(out.double(), ref(x.double()), atol=tol, rtol=tol)


def test_moe_structure_and_validation():
    moe = MoE(6, 5, 8, 2)
    assert moe.router.weight.shape == (8, 6)
    assert moe.experts[0].weight.shape == (8, 10, 6)
    assert moe.experts[2].weight.shape == (8, 6, 5)
    assert isinstance(moe.experts, fo.Sequential)
    with pytest.raises(ValueError, match="top_k"):
        MoE(6, 5, 8, 9)
    with pytest.raises(ValueError, match="activation"):
        MoE(6, 5, 8, 2, activation="tanh")
    with pytest.raises(ValueError, match="score"):
        MoE(6, 5, 8, 2, score="tanh")
    with pytest.raises(ValueError, match=r"\[\.\.\., 6\]"):
        moe(torch.randn(3, 5))


def test_unpermute_probs_gradient_keeps_float64():
    from fusible_ops.moe import unpermute

    rows = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(6, dtype=torch.float64, requires_grad=True)
    token_index = torch.tensor([0, 1, 1, 2, 0, 2])
    assert torch.autograd.gradcheck(lambda r, p: unpermute(r, token_index, 3, probs=p), (rows, probs))


def test_moe_input_dtype_must_match_its_parameters():
    torch.manual_seed(0)
    moe = MoE(8, 6, 4, 2)
    state = {k: v.clone() for k, v in moe.state_dict().items()}
    with pytest.raises(
        ValueError, match="MoE: input dtype torch.float64 does not match the parameters' dtype"
    ):
        moe(torch.randn(2, 3, 8, dtype=torch.float64))
    assert all(torch.equal(state[k], v) for k, v in moe.state_dict().items())
    assert moe(torch.randn(2, 3, 8)).shape == (2, 3, 8)  # the next valid call works


def test_unpermute_result_may_be_modified_in_place():
    """Without a caller buffer the result is a fresh tensor, not a view: ``out += residual`` works."""
    rows = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    token_index = torch.tensor([0, 1, 2, 0, -1, 2])
    out = unpermute(rows, token_index, 3)
    out.mul_(2.0)
    out.sum().backward()
    expected = torch.full((6, 4), 2.0, dtype=torch.float64)
    expected[4] = 0.0  # the dropped row
    torch.testing.assert_close(rows.grad, expected)
    moe = MoE(4, 3, 4, 2, dtype=torch.float64)
    y = moe(torch.randn(5, 4, dtype=torch.float64))
    y += 1.0  # a residual added in place
    y.sum().backward()
    assert moe.router.weight.grad is not None


def test_moe_runs_under_inference_mode():
    """Split sizes made under inference_mode carry no version counter: read, never cached."""
    torch.manual_seed(0)
    moe = MoE(4, 3, 4, 2, dtype=torch.float64)
    x = torch.randn(7, 4, dtype=torch.float64)
    with torch.no_grad():
        expected = moe(x)
    with torch.inference_mode():
        got = moe(x)
        again = moe(x[:5])  # another token count: nothing stale reused
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(again, expected[:5])
