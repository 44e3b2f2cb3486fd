"""The shared sections of the gated activations' docstrings (one text, many classes)."""

from __future__ import annotations

from collections.abc import Callable

_CLAMP_ARGS = """
        limit: clamp bound, a positive number (``float("inf")``: no clamping). Default: 7.0.
        alpha: sigmoid slope, a finite number. Default: 1.702.
        glu_linear_offset: added to the clamped linear part, a finite number. Default: 1.0."""

_INTERLEAVE_ARG = """
        glu_interleave_size: how the last dim splits into gate and linear parts.
            ``None`` (default): the first half is the gate, the second half the
            linear part. ``k`` (a positive int): alternating blocks of ``k`` gate
            columns and ``k`` linear columns (``k=1``: GPT-OSS's interleaved layout)."""

_INPUT = """
        input: ``[..., 2 * n]``, floating point; the last dim must be even (a multiple
            of ``2 * glu_interleave_size`` when that is set)."""

_SCALES = """
        scales: extra input, one value per token row (``prod(input.shape[:-1])``
            values, e.g. ``[rows]`` or ``[rows, 1]``), floating point (may be fp32 with a
            bf16 input), on the input's device; its gradient is returned too."""


def gated_doc(summary: str, *, scaled: bool = False, clamped: bool = False) -> Callable[[type], type]:
    """A class decorator giving a gated activation its docstring: ``summary``, then the
    ``Args`` / ``Shape`` (/ ``Raises``) sections every gated op shares."""
    text = (
        summary
        + "\n\n    Args:"
        + (_CLAMP_ARGS if clamped else "")
        + _INTERLEAVE_ARG
        + "\n\n    Shape:"
        + _INPUT
        + (_SCALES if scaled else "")
        + "\n        output: ``[..., n]``, the input's dtype.\n"
        + ("\n    Raises:\n        ValueError: an option outside the ranges above.\n" if clamped else "")
    )

    def document(cls: type) -> type:
        cls.__doc__ = text
        return cls

    return document
