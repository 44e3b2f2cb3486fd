"""Under torch.compile a call's caller buffers follow eager's aliasing rules, checked
before anything is written: no buffer overlaps another buffer, an input, an extra input
or a parameter of the call."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo

G, H, F, ROWS = 2, 8, 4, 6


def _block(out_features: int = H) -> fo.Sequential:
    torch.manual_seed(0)
    return fo.Sequential(
        fo.GroupedLinear(G, H, 2 * F), fo.ScaledSwiGLU(), fo.GroupedLinear(G, F, out_features)
    )


def _inputs():
    return (
        torch.randn(ROWS, H, requires_grad=True),
        torch.tensor([2, 4]),
        torch.rand(ROWS, requires_grad=True),
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_one_buffer_for_fc1_and_fc2_is_refused_compiled_as_in_eager(backend):
    seq = _block(out_features=2 * F)  # fc1 and fc2 outputs have the same shape
    x, splits, probs = _inputs()
    buf = torch.zeros(ROWS, 2 * F)

    def call(x, splits, probs, buf):
        return seq(
            x,
            splits,
            probs,
            splits,
            op_kwargs={0: {fo.OUTPUT_BUFFER_KEY: buf}, 2: {fo.OUTPUT_BUFFER_KEY: buf}},
        )

    with pytest.raises(ValueError, match="overlaps"):
        call(x, splits, probs, buf)
    with pytest.raises(
        Exception, match=r"buffer 'output' \(op 2\) overlaps GroupedLinear: buffer 'output' \(op 0\)"
    ):
        torch.compile(call, backend=backend, fullgraph=True)(x, splits, probs, buf)
    assert torch.equal(buf, torch.zeros_like(buf))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_output_buffer_overlapping_the_probabilities_is_refused_before_any_write(backend):
    seq = _block()
    x, splits, _ = _inputs()
    memory = torch.zeros(ROWS * H + ROWS)
    memory[:ROWS] = 0.5
    probs, out_buf = memory[:ROWS], memory[: ROWS * H].view(ROWS, H)
    before = memory.clone()

    def call(x, splits, probs, out_buf):
        return seq(x, splits, probs, splits, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: out_buf}})

    with pytest.raises(Exception, match=r"buffer 'output' \(op 2\) overlaps the memory of an input"):
        torch.compile(call, backend=backend, fullgraph=True)(x.detach(), splits, probs, out_buf)
    assert torch.equal(memory, before)


def test_aliasing_that_appears_after_compiling_is_refused():
    # Dynamo retraces when the inputs' aliasing changes; the retrace refuses it
    seq = _block()
    x, splits, _ = _inputs()

    def call(x, splits, probs, out_buf):
        return seq(x, splits, probs, splits, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: out_buf}})

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    out_buf = torch.zeros(ROWS, H)
    want = call(x.detach(), splits, torch.full((ROWS,), 0.5), torch.zeros(ROWS, H)).clone()
    got = compiled(x.detach(), splits, torch.full((ROWS,), 0.5), out_buf)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    memory = torch.zeros(ROWS * H + ROWS)
    memory[:ROWS] = 0.5
    before = memory.clone()
    with pytest.raises(Exception, match="overlaps the memory of an input"):
        compiled(x.detach(), splits, memory[:ROWS], memory[: ROWS * H].view(ROWS, H))
    assert torch.equal(memory, before)


def test_distinct_buffers_compiled_equal_eager_bit_for_bit():
    seq = _block()
    x, splits, probs = _inputs()
    out_buf, grad_buf = torch.zeros(ROWS + 2, H), torch.zeros(ROWS, H)

    def call(x, splits, probs, out_buf, grad_buf):
        kwargs = {2: {fo.OUTPUT_BUFFER_KEY: out_buf}, 0: {fo.GRAD_INPUT_BUFFER_KEY: grad_buf}}
        return seq(x, splits, probs, splits, op_kwargs=kwargs)

    want = call(x, splits, probs, torch.zeros(ROWS + 2, H), torch.zeros(ROWS, H))
    got = torch.compile(call, backend="aot_eager", fullgraph=True)(x, splits, probs, out_buf, grad_buf)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(out_buf[:ROWS], want, rtol=0, atol=0)  # written in place
    assert torch.equal(out_buf[ROWS:], torch.zeros(2, H))  # padded tail untouched


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_sparse_output_buffer_is_refused_by_name(layout):
    seq = _block()
    x, splits, probs = _inputs()
    dense = torch.zeros(ROWS, H)
    buf = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    with pytest.raises(ValueError, match=r"buffer 'output' \(op 2\) must be a dense \(strided\) tensor"):
        seq(x, splits, probs, splits, op_kwargs={2: {fo.OUTPUT_BUFFER_KEY: buf}})
    with pytest.raises(ValueError, match="must be a dense"):  # a direct call of the op too
        seq[0](x, splits, output=torch.zeros(ROWS, 2 * F).to_sparse())
