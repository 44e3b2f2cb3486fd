"""The MoE routing helpers and layer under torch.compile / torch.export: no graph breaks, eager results."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from error_model import BOTH_SIDES, expert_block_terms, tolerance
from torch._dynamo.testing import CompileCounter

from fusible_ops import MoE
from fusible_ops.moe import permute, topk_route, unpermute

E, H, K = 5, 4, 2


def _assert_no_breaks(fn, *args) -> None:
    explanation = torch._dynamo.explain(fn)(*args)
    reasons = [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _leaves(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors)


def _assert_same_forward_backward(fn, inputs: tuple[torch.Tensor, ...]) -> None:
    """``fn`` compiled gives the eager outputs and gradients, bit for bit."""
    eager_in, compiled_in = _leaves(*inputs), _leaves(*inputs)
    eager_out, compiled_out = fn(*eager_in), _compiled(fn)(*compiled_in)
    assert len(eager_out) == len(compiled_out)
    for e, c in zip(eager_out, compiled_out):
        assert e.dtype == c.dtype and torch.equal(e, c)
    grads = [torch.randn_like(t) for t in eager_out if t.requires_grad]
    eager_grads, compiled_grads = (
        torch.autograd.grad(
            [t for t in outs if t.requires_grad],
            [t for t in ins if t.requires_grad],
            grads,
            materialize_grads=True,  # an unused input (probs not passed on) gets zeros
        )
        for outs, ins in ((eager_out, eager_in), (compiled_out, compiled_in))
    )
    for e, c in zip(eager_grads, compiled_grads):
        assert torch.equal(e, c)


def _route_inputs(num_tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randn(num_tokens, H)
    ids = torch.argsort(torch.rand(num_tokens, E), dim=1)[:, :K]
    return tokens, ids, torch.rand(num_tokens, K)


# ---------------------------------------------------------------- helpers: no breaks, eager results


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_route_traces_and_matches_eager(score, renormalize):
    def fn(logits):
        return topk_route(logits, K, score=score, renormalize=renormalize)

    logits = torch.randn(7, E)
    _assert_no_breaks(fn, logits)
    _assert_same_forward_backward(fn, (logits,))


@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("with_order", [True, False])
def test_permute_traces_and_matches_eager(with_probs, with_order):
    order = torch.tensor([3, 0, 4, 1, 2]) if with_order else None

    def fn(tokens, ids, probs):
        perm = permute(tokens, ids, E, probs if with_probs else None, expert_order=order)
        return tuple(t for t in perm if t is not None)

    inputs = _route_inputs()
    _assert_no_breaks(fn, *inputs)
    _assert_same_forward_backward(fn, inputs)


@pytest.mark.parametrize("with_probs", [True, False])
def test_unpermute_traces_and_matches_eager(with_probs):
    def fn(rows, token_index, probs):
        return (unpermute(rows, token_index, 7, probs=probs if with_probs else None),)

    inputs = (torch.randn(14, H), torch.randint(0, 7, (14,)), torch.rand(14))
    _assert_no_breaks(fn, *inputs)
    _assert_same_forward_backward(fn, inputs)


def test_unpermute_into_buffer_under_compile():
    rows, token_index = torch.randn(14, H), torch.randint(0, 7, (14,))
    buf = torch.full((9, H), 7.0)

    def fn(rows, token_index, buf):
        return unpermute(rows, token_index, 7, out=buf)

    _assert_no_breaks(fn, rows, token_index, buf.clone())
    out = _compiled(fn)(rows, token_index, buf)
    assert torch.equal(out, unpermute(rows, token_index, 7))
    assert torch.equal(buf[:7], out) and (buf[7:] == 7.0).all()


def test_full_routing_pipeline_traces_and_matches_eager():
    def fn(tokens, logits):
        probs, ids = topk_route(logits, K)
        perm = permute(tokens, ids, E, probs)
        return (unpermute(perm.rows * 2.0, perm.token_index, tokens.shape[0], probs=perm.probs),)

    inputs = (torch.randn(6, H), torch.randn(6, E))
    _assert_no_breaks(fn, *inputs)
    _assert_same_forward_backward(fn, inputs)


def test_permute_negative_ids_fail_in_the_graph_and_sentinel_ids_are_dropped():
    fn = _compiled(lambda tokens, ids: permute(tokens, ids, E))
    with pytest.raises(RuntimeError, match=r"expert_ids must be >= 0"):
        fn(torch.randn(3, H), torch.tensor([[0], [-1], [1]]))
    perm = fn(torch.randn(3, H), torch.tensor([[0], [E], [1]]))
    assert perm.split_sizes.tolist() == [1, 1, 0, 0, 1]  # the sentinel row sits in the last group
    assert perm.token_index.tolist() == [0, 2, -1]


# ---------------------------------------------------------------- dynamic token counts


def _count_compiles(fn, make_inputs) -> int:
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for num_tokens in range(1, 11):
        compiled(*make_inputs(num_tokens))
    return counter.frame_count


def test_varying_token_counts_compile_at_most_twice():
    route = _count_compiles(lambda logits: topk_route(logits, K), lambda t: (torch.randn(t, E),))
    perm = _count_compiles(lambda tokens, ids, probs: tuple(permute(tokens, ids, E, probs)), _route_inputs)
    unperm = _count_compiles(
        lambda rows, index: unpermute(rows, index, rows.shape[0] // K),
        lambda t: (torch.randn(K * t, H), torch.randint(0, t, (K * t,))),
    )
    assert max(route, perm, unperm) <= 2, {"topk_route": route, "permute": perm, "unpermute": unperm}


@pytest.mark.parametrize("strict", [False, True])
def test_routing_pipeline_exports_with_dynamic_tokens(strict):
    class Routing(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            probs, ids = topk_route(logits, K)
            perm = permute(tokens, ids, E, probs)
            return unpermute(perm.rows, perm.token_index, tokens.shape[0], probs=perm.probs)

    tokens = torch.export.Dim("tokens", min=2, max=1024)
    program = torch.export.export(
        Routing(),
        (torch.randn(6, H), torch.randn(6, E)),
        dynamic_shapes=({0: tokens}, {0: tokens}),
        strict=strict,
    )
    new = (torch.randn(11, H), torch.randn(11, E))
    assert torch.equal(program.module()(*new), Routing()(*new))


# ---------------------------------------------------------------- the MoE layer


def _moe() -> MoE:
    torch.manual_seed(0)
    return MoE(8, 6, 4, 2)


def test_moe_exports_with_dynamic_sequence():
    moe = _moe().eval()
    seq = torch.export.Dim("seq", min=2, max=64)
    with torch.no_grad():
        program = torch.export.export(moe, (torch.randn(2, 5, 8),), dynamic_shapes=({1: seq},))
        x = torch.randn(2, 9, 8)
        assert torch.equal(program.module()(x), moe(x))


def test_moe_train_mode_has_no_graph_break_once_backends_are_chosen():
    moe, x = _moe(), torch.randn(2, 5, 8, requires_grad=True)
    moe(x)  # an eager call picks and caches the grouped-GEMM backends
    _assert_no_breaks(moe, x)


def test_moe_train_mode_has_no_graph_break_on_first_call():
    from fusible_ops.kernels import clear_backend_cache

    clear_backend_cache()  # as in a fresh process: the backends are probed while tracing
    _assert_no_breaks(_moe(), torch.randn(2, 5, 8, requires_grad=True))


@pytest.mark.numerics
def test_compiled_moe_forward_backward_equals_eager():
    moe = _moe()
    x = torch.randn(2, 5, 8, requires_grad=True)
    want = moe(x)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *moe.parameters()])
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *moe.parameters()])
    # float32, both rounding: the expert block (hidden 8, ffn 16, 10 tokens) plus the router's
    # logits (8) and softmax (4 experts), condition <= 4
    tol = tolerance(torch.float32, expert_block_terms(8, 16, 10) + 8 + 4, condition=4 * BOTH_SIDES)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, **tol)
