"""``bench --recipe NAME``: the fused expert block unquantized and under a low-precision
recipe, side by side, with the bytes each saves for backward."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

import fusible_ops as fo

from ..recipes import weight_cache
from .bench import (
    Forward,
    Problem,
    Progress,
    flops,
    fused_forward,
    make_problem,
    results_header,
    saved_bytes,
    time_interleaved,
    timed_call,
)
from .options import BENCH_RECIPES, Shape


def make_recipe(name: str) -> fo.recipes.Recipe:
    """The recipe ``bench --recipe NAME`` runs: :data:`BENCH_RECIPES` ``[NAME]`` with its defaults."""
    return getattr(fo.recipes, BENCH_RECIPES[name])()


def recipe_call(recipe: fo.recipes.Recipe) -> Callable[[Problem, bool], None]:
    """``run(problem, backward)``: the fused block under ``recipe``, forward (and backward)
    inside ``fo.quantized``, its weights quantized afresh (as after an optimizer step)."""
    run = timed_call(fused_forward)

    def call(p: Problem, backward: bool) -> None:
        weight_cache.clear_weight_cache()
        with fo.quantized(recipe):
            run(p, backward)

    return call


def quantized_forward(recipe: fo.recipes.Recipe) -> Forward:
    """The fused forward under ``recipe`` (for :func:`saved_bytes`)."""

    def forward(p: Problem, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        with fo.quantized(recipe):
            return fused_forward(p, x, probs)

    return forward


def run_recipe_bench(
    shape: Shape,
    recipe_name: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    repeats: int = 10,
    warmup: int = 2,
    progress: Progress | None = None,
) -> dict:
    """``bench --recipe``: the fused block unquantized (``fused``, in ``dtype``) and under
    the recipe (``fused_<recipe_name>``), timed interleaved; returns a JSON-ready dict
    shaped as :func:`run_bench`'s, plus the recipe, its plan and whether it was emulated."""
    say = progress or (lambda message: None)
    if repeats < 1:
        raise ValueError(f"run_recipe_bench: repeats must be >= 1, got {repeats}")
    recipe = make_recipe(recipe_name)
    dev = torch.device(device)
    say(f"building the problem: {shape}, {str(dtype).replace('torch.', '')} on {dev}, recipe {recipe!r}")
    p = make_problem(shape, dtype, dev)
    quantized_name = f"fused_{recipe_name}"
    variants = {"fused": timed_call(fused_forward), quantized_name: recipe_call(recipe)}
    with fo.quantized(recipe):
        plan = str(
            p.experts.explain(p.x.detach().requires_grad_(), p.splits_tensor, p.probs, p.splits_tensor)
        )
    results: dict = {
        **results_header(shape, p, dtype, dev, repeats),
        "recipe": recipe_name,
        "recipe_repr": repr(recipe),
        "emulated": "engine emulation" in plan,
        "plan": plan,
        "notes": [],
        "modes": {},
        "saved_bytes": {},
    }
    say("measuring the bytes saved for backward")
    results["saved_bytes"]["fused"] = saved_bytes(fused_forward, p)
    weight_cache.clear_weight_cache()
    results["saved_bytes"][quantized_name] = saved_bytes(quantized_forward(recipe), p)
    for mode, backward in (("forward", False), ("forward+backward", True)):
        say(f"timing {mode}: {len(variants)} variants, {warmup} warm-up + {repeats} rounds")
        times = time_interleaved(variants, p, backward, repeats, warmup, progress)
        results["modes"][mode] = {
            name: {
                "median_ms": statistics.median(samples) * 1e3,
                "min_ms": min(samples) * 1e3,
                "max_ms": max(samples) * 1e3,
                "tflops": flops(shape, backward) / statistics.median(samples) / 1e12,
            }
            for name, samples in times.items()
        }
    return results


def format_recipe_table(results: dict) -> str:
    """The ``--recipe`` table: both variants' medians, their ratio, and their saved bytes."""
    s, name, dtype = results["shape"], results["recipe"], results["dtype"]
    quantized = f"fused_{name}"
    lines = [
        f"MoE expert block: {s['experts']} experts, hidden {s['hidden']}, ffn {s['ffn']}, {s['rows']} rows "
        f"(splits {results['split_sizes']}), {dtype} on {results['device']}, torch {results['torch']}, "
        f"{results['threads']} threads, {results['repeats']} rounds (medians)",
        f"recipe {name}: {results['recipe_repr']}; fused = unquantized {dtype}, {quantized} = under the "
        "recipe (weights quantized afresh every call, as after an optimizer step)",
    ]
    if results["emulated"]:
        lines.append(
            f"note: on {results['device']} the quantization is emulated (quantize, dequantize, then fp32 "
            f"GEMMs), so expect {quantized} to be slower than unquantized {dtype}: these times measure "
            "the emulation, not FP8 hardware speed"
        )
    for mode, rows in results["modes"].items():
        lines += ["", f"[{mode}]", f"{'variant':<20}{'median ms':>11}{'TFLOP/s':>9}{'x fused':>9}"]
        base = rows["fused"]["median_ms"]
        for variant, r in rows.items():
            lines.append(
                f"{variant:<20}{r['median_ms']:>11.3f}{r['tflops']:>9.3f}{r['median_ms'] / base:>9.2f}"
            )
    saved = results["saved_bytes"]
    lines += ["", "bytes saved for backward (activations, via saved-tensor hooks; parameters excluded):"]
    for variant, nbytes in saved.items():
        ratio = f"  ({nbytes / saved['fused']:.2f}x fused)" if variant != "fused" and saved["fused"] else ""
        lines.append(f"  {variant:<17}{nbytes / 2**20:>10.3f} MiB ({nbytes} bytes){ratio}")
    return "\n".join(lines)
