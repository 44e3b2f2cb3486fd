"""Low-precision recipes: how each GEMM operand is quantized.

Every recipe quantizes each GEMM operand along that GEMM's contraction dimension:

- forward ``y = x @ W^T``: ``x`` and ``W`` along in-features;
- dgrad ``dx = dy @ W``: ``dy`` and ``W`` along out-features;
- wgrad ``dW = dy^T @ x``: ``dy`` and ``x`` along the token rows of one group.

A recipe maps an operand (``kind``: ``"input"`` for activations, ``"grad"`` for
gradients, ``"weight"``) and its contraction direction to a *tile* on the operand's 2-D
view and an FP8 format. Activations and gradients are ``[M, C]`` token rows; a weight
``[G, N, K]`` is seen as ``[G * N, K]`` with groups of ``N`` rows. A tile is
``(rows, cols)``: ``None`` rows spans a whole group, ``None`` cols a whole row. Row
tiles start at each group's first row and never cross a group boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .formats import E4M3, E5M2, Fp8Format

#: contraction along the operand's columns (features; a weight's in-features)
ALONG_COLUMNS = "columns"
#: contraction along the operand's rows (token rows of a group; a weight's out-features)
ALONG_ROWS = "rows"

Tile = tuple[int | None, int | None]


def _check_bool(recipe: object, name: str) -> None:
    value = getattr(recipe, name)
    if type(value) is not bool:
        raise TypeError(f"{type(recipe).__name__}: {name} must be a bool, got {value!r}")


@dataclass(frozen=True, repr=False)
class Recipe:
    """Base of the recipes: how each GEMM operand is quantized (see the subclasses).

    Args:
        wgrad_high_precision: run the weight-gradient GEMMs unquantized (exactly a
            ``bool``). Default: False.

    Raises:
        TypeError: a flag that is not a ``bool``.
    """

    wgrad_high_precision: bool = False

    #: short name (``bench --recipe``, plan text)
    name = "recipe"
    #: scales are E8M0 powers of two (MX) rather than fp32
    e8m0_scales = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type in ("bool", bool):
                _check_bool(self, f.name)

    def __repr__(self) -> str:
        # dataclass's own repr guards recursion with the thread id, which torch.compile cannot
        # trace (a plan made while tracing names its recipe)
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"{type(self).__name__}({args})"

    def format_for(self, kind: str) -> Fp8Format:
        """The element format of an operand of ``kind`` (``"input"``, ``"grad"``, ``"weight"``)."""
        return E4M3

    def tile_for(self, kind: str, along: str) -> Tile:
        """The quantization tile of an operand of ``kind`` contracted ``along`` rows or columns."""
        raise NotImplementedError

    @property
    def pow2(self) -> bool:
        """Whether fp32 scales are rounded down to powers of two."""
        return bool(getattr(self, "pow2_scales", False))

    def quantized_gemms(self) -> tuple[str, ...]:
        """The GEMMs that run quantized: fprop and dgrad always, wgrad unless kept high precision."""
        return ("fprop", "dgrad") if self.wgrad_high_precision else ("fprop", "dgrad", "wgrad")


def _along(tile_columns: Tile, along: str) -> Tile:
    """``tile_columns`` is the tile for contraction along columns; rows get its transpose."""
    return tile_columns if along == ALONG_COLUMNS else (tile_columns[1], tile_columns[0])


@dataclass(frozen=True, repr=False)
class MXFP8(Recipe):
    """OCP MX: blocks of 32 values along the contraction dim, one E8M0 scale each, E4M3 data.

    ``amax == 0`` gives ``e = -127``; ``e`` is clamped to ``[-127, 127]``.

    Args:
        wgrad_high_precision: run the weight-gradient GEMMs unquantized (exactly a
            ``bool``). Default: False.
        scale_rounding: how a block's exponent ``e`` is chosen: ``"rceil"`` (default;
            ``e = ceil(log2(amax / 448))``, never saturates) or ``"floor"`` (OCP v1.0:
            ``e = floor(log2(amax)) - 8``, values then saturate to ±448).

    Raises:
        TypeError: ``wgrad_high_precision`` is not a ``bool``.
        ValueError: ``scale_rounding`` is not ``"rceil"`` or ``"floor"``.
    """

    scale_rounding: str = "rceil"

    name = "mxfp8"
    e8m0_scales = True
    block = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scale_rounding not in ("rceil", "floor"):
            raise ValueError(f"MXFP8: scale_rounding must be 'rceil' or 'floor', got {self.scale_rounding!r}")

    def tile_for(self, kind: str, along: str) -> Tile:
        return _along((1, self.block), along)


@dataclass(frozen=True, repr=False)
class Float8Tensorwise(Recipe):
    """Current scaling, one fp32 scale ``fmax / amax`` per operand per group (per expert).

    Args:
        wgrad_high_precision: run the weight-gradient GEMMs unquantized (exactly a
            ``bool``). Default: False.
        fp8_format: ``"hybrid"`` (default; E4M3 inputs and weights, E5M2 gradients) or
            ``"e4m3"`` (E4M3 everywhere).
        pow2_scales: round each fp32 scale down to a power of two (exactly a
            ``bool``). Default: False.

    Raises:
        TypeError: a flag that is not a ``bool``.
        ValueError: ``fp8_format`` is not ``"hybrid"`` or ``"e4m3"``.
    """

    fp8_format: str = "hybrid"
    pow2_scales: bool = False

    name = "tensorwise"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp8_format not in ("hybrid", "e4m3"):
            raise ValueError(
                f"Float8Tensorwise: fp8_format must be 'hybrid' or 'e4m3', got {self.fp8_format!r}"
            )

    def format_for(self, kind: str) -> Fp8Format:
        return E5M2 if kind == "grad" and self.fp8_format == "hybrid" else E4M3

    def tile_for(self, kind: str, along: str) -> Tile:
        return (None, None)


@dataclass(frozen=True, repr=False)
class Float8Rowwise(Recipe):
    """One fp32 scale per vector along the contraction dim (per token row of activations,
    per output row of weights in forward), E4M3 data.

    Args:
        wgrad_high_precision: run the weight-gradient GEMMs unquantized (exactly a
            ``bool``). Default: False.
        pow2_scales: round each fp32 scale down to a power of two (exactly a
            ``bool``). Default: False.

    Raises:
        TypeError: a flag that is not a ``bool``.
    """

    pow2_scales: bool = False

    name = "rowwise"

    def tile_for(self, kind: str, along: str) -> Tile:
        return _along((1, None), along)


@dataclass(frozen=True, repr=False)
class Float8Blockwise(Recipe):
    """DeepSeek-V3 style: 1x128 tiles for activations and gradients, 128x128 blocks for
    weights, E4M3 data, one fp32 scale per tile.

    Args:
        wgrad_high_precision, pow2_scales: as for :class:`Float8Rowwise`.

    Raises:
        TypeError: a flag that is not a ``bool``.
    """

    pow2_scales: bool = False

    name = "blockwise"
    block = 128

    def tile_for(self, kind: str, along: str) -> Tile:
        if kind == "weight":
            return (self.block, self.block)
        return _along((1, self.block), along)


#: how quantized GEMMs may run (``fusible_ops.quantized(recipe, backend=...)``)
RECIPE_BACKENDS = ("auto", "emulation", "scaled_mm", "scaled_grouped_mm")

#: ``bench --recipe`` names
RECIPES_BY_NAME: dict[str, type[Recipe]] = {
    cls.name: cls for cls in (MXFP8, Float8Tensorwise, Float8Rowwise, Float8Blockwise)
}
