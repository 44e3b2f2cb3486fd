"""``fo.quantized`` reaches Hugging Face MoE models running on the fusible-ops experts
implementation (a tiny random Mixtral, float32: recipes take bfloat16, float16, float32)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
fot = pytest.importorskip("fusible_ops.integrations.transformers")

from hf_tiny_models import experts_modules, tiny_model  # noqa: E402

import fusible_ops as fo  # noqa: E402
from fusible_ops.moe import permute, unpermute  # noqa: E402


def _run(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_hf_mixtral_honours_fo_quantized():
    model = tiny_model("mixtral", torch.float32, layers=1).train()
    model.set_experts_implementation("fusible_ops")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    recipe = fo.recipes.MXFP8()
    plain_logits, plain_grads = _run(model, ids)
    with fo.quantized(recipe):
        logits, grads = _run(model, ids)
    (experts,) = experts_modules(model)
    plan = fot.cached_ops(experts).last_plan
    assert f"recipe {recipe!r}" in str(plan) and "fprop, dgrad, wgrad quantized" in str(plan), plan
    assert plan.fusion_plans[0].forward_op_types() == ["GroupedMLP"], plan
    # quantized: different from the unquantized run, close to it
    assert 0 < _rel(logits, plain_logits) < 0.05
    for name in ("gate_up_proj", "down_proj"):
        key = next(k for k in grads if k.endswith(f"experts.{name}"))
        assert 0 < _rel(grads[key], plain_grads[key]) < 0.2, key
    # outside the block the model is unquantized again
    again, _ = _run(model, ids)
    assert torch.equal(again, plain_logits)
    assert "recipe" not in str(fot.cached_ops(experts).last_plan)

    # the experts alone: the same as the fusible-ops Sequential built from them (sharing
    # the parameters) on the same routed rows, under the same recipe
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 64, generator=gen)
    top_k = torch.stack([torch.randperm(7, generator=gen)[:2] for _ in range(9)])  # expert 7: no token
    weights = torch.rand(9, 2, generator=gen)
    perm = permute(x, top_k, experts.num_experts, weights)
    ops = fot.from_hf_experts(experts)
    with torch.no_grad(), fo.quantized(recipe):
        got = fot.experts_forward(experts, x, top_k, weights)
        want = unpermute(ops(perm.rows, perm.split_sizes, perm.probs, perm.split_sizes), perm.token_index, 9)
    with torch.no_grad():
        plain = fot.experts_forward(experts, x, top_k, weights)
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)
