"""in_out weights on the CUDA backends (run by benchmarks/gpu_check.sh; skipped without CUDA).

The same checks as tests/test_weight_layout.py against the float64 reference, for the
backends a GPU offers: grouped_mm (SM90+), triton, and whichever the fuser picks.
"""

from __future__ import annotations

import pytest
import reference_ops as ref
import torch

import fusible_ops as fo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SPLITS = [48, 0, 80, 128]
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _backends() -> list[str]:
    from fusible_ops.kernels import get_backend

    names = ["auto"]
    for name in ("grouped_mm", "triton"):
        try:
            if get_backend(name).probe(torch.device("cuda"), torch.bfloat16) is None:
                names.append(name)
        except Exception:  # noqa: BLE001  (not registered / not importable here)
            continue
    return names


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpt_oss_layout_block_on_cuda_matches_reference(backend, dtype):
    torch.manual_seed(0)
    fc1 = fo.GroupedLinear(4, 128, 256, bias=True, weight_layout="in_out", device="cuda", dtype=dtype)
    fc2 = fo.GroupedLinear(4, 128, 128, bias=True, weight_layout="in_out", device="cuda", dtype=dtype)
    seq = fo.Sequential(fc1, fo.ClampedSwiGLU(glu_interleave_size=1), fc2, fo.Scale())
    rows = sum(SPLITS)
    x = torch.randn(rows, 128, device="cuda", dtype=dtype, requires_grad=True)
    probs = torch.rand(rows, device="cuda")
    grad = torch.randn(rows, 128, device="cuda", dtype=dtype)
    splits = torch.tensor(SPLITS, device="cuda")
    with fo.settings(backend=backend):
        y = seq(x, splits, splits, probs)
    y.backward(grad)
    assert seq.last_plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"], seq.last_plan

    x64, w1, b1, w2, b2 = (ref.leaf(t.cpu()) for t in (x, fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    h = ref.grouped_linear(x64, w1.transpose(1, 2), b1, SPLITS)
    act = ref.activation("clamped_swiglu", h, 1)
    expected = ref.grouped_linear(act, w2.transpose(1, 2), b2, SPLITS) * probs.cpu().double()[:, None]
    expected.backward(grad.cpu().double())
    assert ref.max_rel_err(y.cpu(), expected) <= TOL[dtype]
    assert ref.max_rel_err(x.grad.cpu(), x64.grad) <= TOL[dtype]
    for p, leaf in ((fc1.weight, w1), (fc2.weight, w2), (fc1.bias, b1), (fc2.bias, b2)):
        assert p.grad.shape == p.shape and p.grad.is_contiguous()
        assert ref.max_rel_err(p.grad.cpu(), leaf.grad) <= TOL[dtype]
