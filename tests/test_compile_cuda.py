"""CUDA only: the compiled expert block with device split sizes never syncs with the host
and can be captured in a CUDA graph (run by benchmarks/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXPERTS, HIDDEN, FFN, ROWS = 4, 64, 128, 96


def _block_and_inputs():
    torch.manual_seed(0)
    seq = fo.Sequential(
        fo.GroupedLinear(EXPERTS, HIDDEN, 2 * FFN, device="cuda", dtype=torch.bfloat16),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(EXPERTS, FFN, HIDDEN, device="cuda", dtype=torch.bfloat16),
    )
    splits = torch.tensor([40, 0, 32, 24], device="cuda")
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(ROWS, device="cuda", requires_grad=True)
    return seq, x, probs, splits


def test_compiled_block_with_device_splits_never_syncs():
    seq, x, probs, splits = _block_and_inputs()
    compiled = torch.compile(seq, fullgraph=True)
    compiled(x, splits, probs, splits).sum().backward()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = compiled(x, splits, probs, splits)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = seq(x, splits, probs, splits)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def test_compiled_forward_is_captured_in_a_cuda_graph():
    seq, x, probs, splits = _block_and_inputs()
    compiled = torch.compile(seq, fullgraph=True)
    static_x = x.detach().clone()
    static_probs = probs.detach().clone()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                compiled(static_x, splits, static_probs, splits)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = compiled(static_x, splits, static_probs, splits)
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(
            static_out, seq(static_x, splits, static_probs, splits), rtol=2e-2, atol=2e-2
        )
