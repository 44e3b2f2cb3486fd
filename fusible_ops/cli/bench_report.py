"""What ``bench`` prints and writes: the table (medians, TFLOP/s, one ratio direction and
the same figure in words, saved bytes), the JSON file and the bar chart."""

from __future__ import annotations

import json


def _faster_or_slower(fused_ms: float, other_ms: float, other: str) -> str:
    """``"31% faster than grouped_mm"``: the same ratio as the table's column, in words."""
    ratio = fused_ms / other_ms
    if ratio <= 1:
        return f"{(1 - ratio) * 100:.0f}% faster than {other}"
    return f"{(ratio - 1) * 100:.0f}% slower than {other}"


def format_table(results: dict) -> str:
    """The human-readable table: medians, TFLOP/s, ratios and saved bytes."""
    if "recipe" in results:
        from .recipe_bench import format_recipe_table

        return format_recipe_table(results)
    lines = []
    s = results["shape"]
    lines.append(
        f"MoE expert block: {s['experts']} experts, hidden {s['hidden']}, ffn {s['ffn']}, {s['rows']} rows "
        f"(splits {results['split_sizes']}), {results['dtype']} on {results['device']}, "
        f"torch {results['torch']}, {results['threads']} threads, {results['repeats']} rounds (medians)"
    )
    for mode, rows in results["modes"].items():
        names = list(rows)
        lines.append("")
        lines.append(f"[{mode}]")
        header = f"{'variant':<20}{'median ms':>11}{'TFLOP/s':>9}{'x dense':>9}"
        peers = [n for n in names if n not in ("fused", "dense", "fused_compiled")]
        header += "".join(f"{'fused/' + n:>27}" for n in peers if "fused" in rows)
        lines.append(header)
        dense = rows.get("dense", {}).get("median_ms")
        for name in names:
            r = rows[name]
            line = f"{name:<20}{r['median_ms']:>11.3f}{r['tflops']:>9.3f}"
            line += f"{r['median_ms'] / dense:>9.2f}" if dense else f"{'-':>9}"
            if name == "fused":
                line += "".join(f"{r['median_ms'] / rows[n]['median_ms']:>27.2f}" for n in peers)
            lines.append(line)
        if "fused" in rows and peers:
            lines.append(
                "fused/X = fused time / X's time: below 1 fused is faster ("
                + ", ".join(
                    _faster_or_slower(rows["fused"]["median_ms"], rows[n]["median_ms"], n) for n in peers
                )
                + ")"
            )
        if "fused_compiled" in rows and "grouped_mm_compiled" in rows:
            ratio = rows["fused_compiled"]["median_ms"] / rows["grouped_mm_compiled"]["median_ms"]
            lines.append(f"compiled: fused_compiled / grouped_mm_compiled = {ratio:.2f}")
    for note in results.get("notes", []):
        lines.append("")
        lines.append(f"note: {note}")
    if results["saved_bytes"]:
        lines.append("")
        lines.append("bytes saved for backward (activations, via saved-tensor hooks; parameters excluded):")
        base = results["saved_bytes"].get("unfused")
        for name, nbytes in results["saved_bytes"].items():
            ratio = f"  ({nbytes / base:.2f}x unfused)" if base else ""
            lines.append(f"  {name:<11}{nbytes / 2**20:>10.2f} MiB{ratio}")
    if "moe_ep" in results:
        ep = results["moe_ep"]
        lines.append("")
        lines.append(
            "MoE layer forward+backward (informational; 512 tokens, hidden 256, ffn 512, 8 experts, top-2, "
            "fp32, gloo on CPU):"
        )
        from .moe_ep_bench import format_moe_ep

        lines.extend(format_moe_ep(ep))
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Bar chart of median ms per variant and mode (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["modes"])
    names = list(results["modes"][modes[0]])
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6))
    for ax, mode in zip(axes, modes):
        values = [results["modes"][mode][n]["median_ms"] for n in names]
        bars = ax.bar(names, values, color=["#2a7" if n == "fused" else "#888" for n in names])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(f"{mode} (median ms, lower is better)")
        ax.set_ylabel("ms")
    s = results["shape"]
    fig.suptitle(
        f"MoE expert block, {s['experts']}x[{s['hidden']}->{2 * s['ffn']}->{s['hidden']}], "
        f"{s['rows']} rows, {results['dtype']} on {results['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(results: dict, path: str) -> None:
    """Write ``results`` to ``path`` as JSON and say so on stdout."""
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {path}")
