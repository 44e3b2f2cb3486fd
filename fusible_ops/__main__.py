"""Command line: ``python -m fusible_ops {demo,bench,info}``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fusible_ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="MoE expert block on synthetic tokens: check, plan, train, timings")
    demo.add_argument("--steps", type=int, default=30, help="training steps of the small MoE regression")

    bench = sub.add_parser(
        "bench", help="fused expert block vs unfused, grouped_mm, loop and the dense bound"
    )
    bench.add_argument("--small", action="store_true", help="4 experts, hidden 64, ffn 64, 64 rows")
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bench.add_argument(
        "--backend", default="auto", help="force a kernel backend (names: python -m fusible_ops info)"
    )
    bench.add_argument("--experts", type=int)
    bench.add_argument("--hidden", type=int)
    bench.add_argument("--ffn", type=int)
    bench.add_argument("--rows", type=int)
    bench.add_argument("--repeats", type=int, help="timed rounds (default 10, or 50 with --small)")
    bench.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time fused and grouped_mm under torch.compile (default: on with --small)",
    )
    bench.add_argument("--json", help="write the results as JSON to this file")
    bench.add_argument("--plot", help="write a bar chart PNG to this file (needs matplotlib)")
    bench.add_argument("--moe-ep", action="store_true", help="add the MoE layer single-process vs EP=2 row")

    sub.add_parser("info", help="versions, devices and kernel backends")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .cli.demo import main as run
    elif args.command == "bench":
        from .cli.bench import main as run
    else:
        from .cli.info import main as run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
