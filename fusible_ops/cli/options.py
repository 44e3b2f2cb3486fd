"""What the command line's parser needs, without torch: ``--help`` answers at once.

The defaults here are the ones the commands run with (``cli.args`` reads them too), so
the help text cannot drift from what a run does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

BENCH_DTYPES = ("bfloat16", "float16", "float32")
HF_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
#: ``bench --recipe`` names -> the ``fusible_ops.recipes`` class each runs, default options
BENCH_RECIPES = {
    "mxfp8": "MXFP8",
    "tensorwise": "Float8Tensorwise",
    "rowwise": "Float8Rowwise",
    "blockwise": "Float8Blockwise",
}

#: timed rounds of ``bench``: the full shape, ``--small`` (tiny calls on a shared machine
#: need many) and ``--hf``
DEFAULT_REPEATS = 10
SMALL_REPEATS = 300
HF_REPEATS = 3
#: warm-up rounds before the timed ones
DEFAULT_WARMUP = 2
SMALL_WARMUP = 3


@dataclass(frozen=True)
class Shape:
    """The expert block's problem: ``experts`` x ``[hidden -> 2 ffn -> hidden]`` on ``rows`` routed rows."""

    experts: int = 8
    hidden: int = 1024
    ffn: int = 1408
    rows: int = 8192


DEFAULT_SHAPE = Shape()
SMALL_SHAPE = Shape(experts=4, hidden=64, ffn=64, rows=64)


class UsageError(Exception):
    """A bad command-line argument found after parsing (an unavailable device, backend...).

    ``python -m fusible_ops`` reports it as one ``python -m fusible_ops CMD: error: ...``
    line on stderr and exits with status 2, as argparse does for its own errors.
    """


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {value}")
    return value


DEMO_DESCRIPTION = """\
The MoE expert block end to end on the CPU:

  1. an expert block runs forward and backward on synthetic routed tokens with caller
     buffers, checked against a plain-PyTorch float64 reference;
  2. the fusion plan of that call (what ran, which backend, and why);
  3. a small MoE regression trained for --steps steps; the loss on a fixed evaluation
     batch is printed along the way and must go down (exit status 1 if it does not);
  4. the small-shape timing table (fused vs its peers)."""
