"""``python -m fusible_ops bench --hf FAMILY``: one HF MoE experts module, three implementations.

Times forward + backward of the experts module of a one-layer model of ``FAMILY`` built
from its config (random weights), on fixed routing, for transformers' ``eager`` and
``grouped_mm`` experts implementations and ``fusible_ops``; one call of each per round,
medians over the rounds, in bf16 and fp32. Needs the ``transformers`` extra.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch

from .bench import shuffled_rounds
from .options import HF_FAMILIES as FAMILIES

IMPLEMENTATIONS = ("eager", "grouped_mm", "fusible_ops")


#: a realistic CPU shape: 2048 tokens, hidden 1024, 32 experts, ffn 512, top-4
class HfShape(NamedTuple):
    tokens: int
    hidden: int
    experts: int
    ffn: int
    top_k: int


HfShape.__new__.__defaults__ = (2048, 1024, 32, 512, 4)
DEFAULT_HF_SHAPE = HfShape()


def _config(family: str, shape: HfShape):
    import transformers as t

    common = dict(vocab_size=128, hidden_size=shape.hidden, num_hidden_layers=1, num_attention_heads=8,
                  num_key_value_heads=8, num_experts_per_tok=shape.top_k)  # fmt: skip
    moe = dict(moe_intermediate_size=shape.ffn, intermediate_size=shape.ffn)
    if family == "mixtral":
        return t.MixtralConfig(**common, intermediate_size=shape.ffn, num_local_experts=shape.experts)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**common, **moe, num_experts=shape.experts, head_dim=shape.hidden // 8)
    if family == "qwen2_moe":
        return t.Qwen2MoeConfig(
            **common, **moe, num_experts=shape.experts, shared_expert_intermediate_size=shape.ffn
        )
    if family == "olmoe":
        return t.OlmoeConfig(**common, intermediate_size=shape.ffn, num_experts=shape.experts)
    if family == "deepseek_v3":
        return t.DeepseekV3Config(**common, **moe, n_routed_experts=shape.experts, n_group=1, topk_group=1,
                                  first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=64)  # fmt: skip
    if family == "gpt_oss":
        return t.GptOssConfig(**common, intermediate_size=shape.ffn, num_local_experts=shape.experts,
                              head_dim=shape.hidden // 8)  # fmt: skip
    raise ValueError(f"bench --hf: unknown model family {family!r}; expected one of {FAMILIES}")


def experts_module(family: str, shape: HfShape, dtype: torch.dtype) -> torch.nn.Module:
    """The experts module of a one-layer ``family`` model (random weights) in ``dtype``."""
    import warnings

    import transformers

    import fusible_ops.integrations.transformers  # noqa: F401  (registers "fusible_ops")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(_config(family, shape))
    experts = next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj"))
    return experts.to(dtype)


def _time_once(experts, implementation, x, top_k, weights, grad) -> float:
    experts.config._experts_implementation = implementation
    start = time.perf_counter()
    out = experts(x, top_k, weights)
    out.backward(grad)
    return time.perf_counter() - start


def run_hf_bench(family: str, dtypes=("bfloat16", "float32"), shape: HfShape = DEFAULT_HF_SHAPE, repeats: int = 3,
                 progress=None) -> dict:  # fmt: skip
    """``{dtype: {implementation: median ms}}`` plus the shape; every implementation checked
    against eager before timing (max relative difference recorded)."""
    results: dict = {
        "family": family,
        "shape": shape._asdict(),
        "repeats": repeats,
        "medians_ms": {},
        "max_rel_diff": {},
    }
    gen = torch.Generator().manual_seed(0)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        experts = experts_module(family, shape, dtype)
        x = torch.randn(shape.tokens, shape.hidden, generator=gen).to(dtype).requires_grad_()
        logits = torch.randn(shape.tokens, shape.experts, generator=gen)
        probs, top_k = torch.softmax(logits, -1).topk(shape.top_k, -1)
        weights = (probs / probs.sum(-1, keepdim=True)).to(dtype)
        grad = torch.randn(shape.tokens, shape.hidden, generator=gen).to(dtype)
        outputs = {}
        for implementation in IMPLEMENTATIONS:  # warm-up, and the check
            experts.config._experts_implementation = implementation
            with torch.no_grad():
                outputs[implementation] = experts(x, top_k, weights).float()
        ref = outputs["eager"]
        results["max_rel_diff"][dtype_name] = {
            name: float((out - ref).abs().max() / ref.abs().max()) for name, out in outputs.items()
        }
        times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        # round 0 warms up the backward; a fresh order each round (see bench.time_interleaved)
        for round_index, order in enumerate(shuffled_rounds(list(IMPLEMENTATIONS), 1 + repeats)):
            for implementation in order:
                if progress:
                    progress(f"{family} {dtype_name}: round {round_index}/{repeats} {implementation}")
                seconds = _time_once(experts, implementation, x, top_k, weights, grad)
                if round_index:
                    times[implementation].append(seconds)
                x.grad = None
                experts.zero_grad(set_to_none=True)
        results["medians_ms"][dtype_name] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return results


def format_hf_table(results: dict) -> str:
    s = results["shape"]
    lines = [
        f"HF {results['family']} experts, {s['experts']} experts, hidden {s['hidden']}, ffn {s['ffn']}, "
        f"top-{s['top_k']}, {s['tokens']} tokens; forward+backward, median of {results['repeats']} rounds (ms)",
        "| dtype | eager | grouped_mm | fusible_ops | eager / fusible_ops | grouped_mm / fusible_ops |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, medians in results["medians_ms"].items():
        e, g, f = (medians[name] for name in IMPLEMENTATIONS)
        lines.append(f"| {dtype} | {e:.1f} | {g:.1f} | {f:.1f} | {e / f:.2f}x | {g / f:.2f}x |")
    diffs = ", ".join(
        f"{dtype}: " + " ".join(f"{name} {value:.1e}" for name, value in d.items() if name != "eager")
        for dtype, d in results["max_rel_diff"].items()
    )
    lines.append(f"max relative difference of the outputs to eager: {diffs}")
    return "\n".join(lines)


def main(
    family: str,
    repeats: int,
    progress: bool,
    *,
    dtypes: tuple[str, ...] = ("bfloat16", "float32"),
    json_path: str | None = None,
) -> int:
    """``bench --hf FAMILY``: the table on stdout, progress lines on stderr, JSON when asked."""
    from .bench import print_progress, write_json

    results = run_hf_bench(
        family, dtypes=dtypes, repeats=repeats, progress=print_progress if progress else None
    )
    print(format_hf_table(results))
    if json_path:
        write_json(results, json_path)
    return 0
