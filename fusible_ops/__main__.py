"""Command line: python -m fusible_ops {demo,bench,info}.

Parsing imports nothing heavy (``--help`` answers without torch); a command's module,
and torch with it, loads once its arguments parsed.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from .cli.options import (
    BENCH_DTYPES,
    BENCH_RECIPES,
    DEFAULT_REPEATS,
    DEFAULT_SHAPE,
    DEMO_DESCRIPTION,
    HF_FAMILIES,
    HF_REPEATS,
    SMALL_REPEATS,
    SMALL_SHAPE,
    UsageError,
    positive_int,
)

DESCRIPTION = """\
fusible-ops command line:

  demo    the MoE expert block end to end on the CPU: checked against a float64
          reference, its fusion plan, a short training run, a small timing table
  bench   the expert block fused vs unfused, a torch._grouped_mm composition,
          a per-expert loop and the dense torch.mm bound
  info    versions, devices and every kernel backend's availability

Run "python -m fusible_ops COMMAND --help" for a command's flags."""


BENCH_DESCRIPTION = """\
Times the MoE expert block (GroupedLinear -> ScaledSwiGLU -> GroupedLinear) fused
against its peers, one call of each variant per round, and prints the medians:

  fused         fo.Sequential of the three ops, fusion on
  unfused       the same Sequential under fo.settings(fusion=False)
  grouped_mm    a torchtitan-style composition (torch._grouped_mm, silu(gate) * up *
                probs, torch._grouped_mm) differentiated by autograd
  loop          a per-expert eager loop of F.linear
  dense         the bound: the same GEMMs as plain torch.mm, nothing else
  *_compiled    fused and grouped_mm under torch.compile (with --compile)

With --recipe NAME it times instead the fused block unquantized (fused) and under that
low-precision recipe (fused_NAME), side by side, with the bytes each saves for backward."""

BENCH_EPILOG = """\
--hidden and --ffn must be multiples of 8 for bfloat16/float16 and of 4 for float32
(torch._grouped_mm, behind the grouped_mm variant, needs 16-byte aligned feature sizes;
--recipe runs no grouped_mm variant and takes any size).
Progress lines go to stderr; the plan, the tables and "wrote FILE" go to stdout."""


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` flags (checked by ``cli.args.check_bench_args``); every help line states the default.

    Flags whose default is None are told apart from the default value, so that ``--hf``
    can refuse the ones it does not read.
    """
    d, s = DEFAULT_SHAPE, SMALL_SHAPE
    parser.add_argument(
        "--small",
        action="store_true",
        help=f"the small shape: {s.experts} experts, hidden {s.hidden}, ffn {s.ffn}, {s.rows} rows, "
        f"{SMALL_REPEATS} rounds, compiled variants on (default: off, the full shape)",
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument(
        "--dtype",
        choices=BENCH_DTYPES,
        help="dtype of weights and tokens (default: bfloat16; with --hf: bfloat16 and float32)",
    )
    parser.add_argument(
        "--backend",
        help="kernel backend to force, or auto to pick per device and dtype; "
        "python -m fusible_ops info lists the names (default: auto)",
    )
    for name, help_text in (
        ("experts", "number of experts"),
        ("hidden", "hidden size (in of fc1, out of fc2)"),
        ("ffn", "expert FFN size (fc1 gives 2 x ffn: gate and up)"),
        ("rows", "routed rows (tokens x top-k), split unevenly over the experts"),
    ):
        parser.add_argument(
            f"--{name}",
            type=positive_int,
            metavar="N",
            help=f"{help_text} (default: {getattr(d, name)}, or {getattr(s, name)} with --small)",
        )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        metavar="N",
        help="timed rounds; tiny calls on a shared machine need many "
        f"(default: {DEFAULT_REPEATS}, or {SMALL_REPEATS} with --small, {HF_REPEATS} with --hf)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time fused and grouped_mm under torch.compile (default: on with --small, else off)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="print a line per stage, and per variant of every round (of at most 10 rounds "
        "spread over the run) to stderr (default: on)",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="write the results as JSON to FILE, also with --hf (default: none)"
    )
    parser.add_argument(
        "--plot", metavar="FILE", help="write a bar chart PNG to FILE, needs matplotlib (default: none)"
    )
    parser.add_argument(
        "--moe-ep",
        action="store_true",
        help="add the MoE layer single-process vs EP=2 row (default: off)",
    )
    parser.add_argument(
        "--recipe",
        choices=tuple(BENCH_RECIPES),
        help="instead: the fused block unquantized (in --dtype) vs under this low-precision recipe "
        f"({', '.join(f'{k}: {v}()' for k, v in BENCH_RECIPES.items())}), time and bytes saved "
        "for backward; each call quantizes the weights afresh, as a training step does; on the CPU "
        "the quantization is emulated (quantize, dequantize, fp32 GEMMs), so slower than "
        "unquantized; refuses --compile and --moe-ep (default: none)",
    )
    parser.add_argument(
        "--hf",
        metavar="FAMILY",
        choices=HF_FAMILIES,
        help=f"instead: one Hugging Face MoE experts module of FAMILY ({', '.join(HF_FAMILIES)}), "
        "transformers' eager and grouped_mm vs fusible_ops, on the CPU, 2048 tokens, hidden 1024, "
        "32 experts, ffn 512, top-4; reads --dtype, --repeats, --progress and --json and refuses "
        "the other flags; needs transformers (default: none)",
    )


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; each flag's help ends with its default.

    A flag whose default depends on others (``None`` here) states it in its own help.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (
            "(default" in help_text
            or action.default in (None, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return help_text
        return help_text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one ``PROG: error: MESSAGE`` line and exit status 2.

    A flag is never matched by a prefix of its name (``allow_abbrev=False``).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m fusible_ops``; ``parser.commands`` maps a command to its sub-parser."""
    parser = _Parser(prog="python -m fusible_ops", description=DESCRIPTION, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{demo,bench,info}", parser_class=_Parser
    )

    demo = sub.add_parser(
        "demo",
        help="MoE expert block on synthetic tokens: check, plan, train, timings",
        description=DEMO_DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    demo.add_argument(
        "--steps",
        type=positive_int,
        default=30,
        metavar="N",
        help="training steps of the small MoE regression (any N >= 1)",
    )

    bench = sub.add_parser(
        "bench",
        help="fused expert block vs unfused, grouped_mm, loop and the dense bound",
        description=BENCH_DESCRIPTION,
        epilog=BENCH_EPILOG,
        formatter_class=_HelpFormatter,
    )
    add_bench_arguments(bench)

    info = sub.add_parser(
        "info",
        help="versions, devices and kernel backends",
        description="Versions, devices, and every kernel backend: available or not, and why.",
        formatter_class=_HelpFormatter,
    )
    parser.commands = {"demo": demo, "bench": bench, "info": info}
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named with the command they were given to, whose --help lists its flags
        parser.commands[args.command].error(
            f"unrecognized argument{'s' if len(unknown) > 1 else ''}: {' '.join(unknown)} "
            f"(python -m fusible_ops {args.command} --help lists its flags)"
        )
    # torch warns at import when numpy is absent; nothing here uses numpy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    if args.command == "demo":
        from .cli.demo import main as run
    elif args.command == "bench":
        from .cli.bench import main as run
    else:
        from .cli.info import main as run
    try:
        return run(args)
    except UsageError as error:
        parser.exit(2, f"{parser.prog} {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
