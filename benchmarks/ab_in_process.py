"""Two revisions of the library in one process: the per-call time of the fused expert block.

Run: ``python benchmarks/ab_in_process.py BASE_REV [--rounds 300] [--base-first] [--like-bench]``

Runs on separate checkouts (one after the other) differ by more than a code change on a
shared machine. This script copies ``fusible_ops/`` of ``BASE_REV`` (``git archive``) into
a temporary folder as a package named ``fusible_ops_base`` (its custom ops in their own
namespace), imports it next to the working tree's ``fusible_ops``, gives both the same
weights, and times at ``bench --small``'s shape, interleaved in a fresh random order per
round: the base's fused block, the working tree's, the composition and the loop (and
``dense``). It prints the medians and ``work / base``. Run it once with each copy listed
first (``--base-first``): the ratio should not depend on that.
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def import_base(rev: str, folder: Path):
    """``fusible_ops`` of ``rev`` as the package ``fusible_ops_base`` under ``folder``."""
    archive = subprocess.run(
        ["git", "archive", rev, "fusible_ops"], cwd=ROOT, capture_output=True, check=True
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    package = folder / "fusible_ops_base"
    (folder / "fusible_ops").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\bfusible_ops\b", "fusible_ops_base", path.read_text()))
    sys.path.insert(0, str(folder))
    from fusible_ops_base.cli import bench as base_bench

    return base_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the git revision to compare against (e.g. HEAD~1)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--base-first", action="store_true", help="list the base's variant first")
    parser.add_argument(
        "--like-bench",
        action="store_true",
        help="also run bench --small's other variants (both revisions unfused; the working tree's "
        "and the composition compiled): its cache pressure",
    )
    args = parser.parse_args(argv)
    from fusible_ops.cli import bench

    with tempfile.TemporaryDirectory() as folder:
        base = import_base(args.base, Path(folder))
        p_work = bench.make_problem(bench.SMALL_SHAPE, torch.bfloat16, torch.device("cpu"))
        p_base = base.make_problem(base.SMALL_SHAPE, torch.bfloat16, torch.device("cpu"))
        with torch.no_grad():
            for mine, theirs in zip(p_base.experts.parameters(), p_work.experts.parameters()):
                mine.copy_(theirs)

        def on(p, run):
            return lambda _problem, backward: run(p, backward)

        fused = {
            "base": on(p_base, base.timed_call(base.fused_forward)),
            "work": on(p_work, bench.timed_call(bench.fused_forward)),
        }
        variants = dict(sorted(fused.items(), reverse=not args.base_first))
        variants["grouped_mm"] = on(p_work, bench.timed_call(bench.grouped_mm_forward))
        variants["loop"] = on(p_work, bench.timed_call(bench.loop_forward))
        variants["dense"] = bench.DenseBound(p_work)
        if args.like_bench:
            # both revisions' unfused and compiled blocks: one revision's code running twice
            # per round would warm its caches for its fused call (an A/A run read 0.94)
            variants["base_unfused"] = on(p_base, base.timed_call(base.unfused_forward))
            variants["work_unfused"] = on(p_work, bench.timed_call(bench.unfused_forward))
            # the working tree's block compiled, next to the compiled composition (its ratio,
            # not an A/B: two copies of the library compiled in one process disturb each other)
            for name in ("fused", "grouped_mm"):
                forward = bench.compiled(bench.FORWARDS[name])
                variants[f"{name}_compiled"] = on(p_work, bench.timed_call(forward))
        print(f"{bench.SMALL_SHAPE}, bf16, {args.rounds} rounds, base {args.base} vs the working tree")
        for mode, backward in (("forward", False), ("forward+backward", True)):
            times = bench.time_interleaved(variants, p_work, backward, args.rounds, 3)
            med = {name: statistics.median(samples) * 1e6 for name, samples in times.items()}
            print(
                f"{mode}: base {med['base']:.0f} us, work {med['work']:.0f} us, composition "
                f"{med['grouped_mm']:.0f} us; work / base {med['work'] / med['base']:.3f}; "
                f"/ composition: base {med['base'] / med['grouped_mm']:.2f}, work {med['work'] / med['grouped_mm']:.2f}"
            )
            if args.like_bench:
                ratio = med["fused_compiled"] / med["grouped_mm_compiled"]
                print(f"{mode}, compiled: work / composition {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
