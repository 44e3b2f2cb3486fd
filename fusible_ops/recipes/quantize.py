"""Quantizers: an operand's 2-D view, tiled along its contraction direction, to FP8 data
and per-tile scales.

Rows fall into groups (the token rows of each expert, or the ``N`` rows of each expert's
weight). Row tiles start at each group's first row and never straddle two groups; rows
past the last group (a padded tail) form tiles of their own. Column tiles start at
column 0; a last, partial tile covers what is left. Everything runs on the operand's
device with static shapes (no host sync, traceable by ``torch.compile``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Fp8Format, cast_saturated
from .recipes import Recipe, Tile
from .scales import float_scales, mx_scales

Tensor = torch.Tensor


@dataclass
class QuantizedOperand:
    """FP8 data of a 2-D operand and its tile scales.

    ``data``: ``[R, C]`` in ``fmt.dtype``; ``scale_inv``: fp32 ``[row tiles, column tiles]``
    (dequantized value = ``data * scale_inv`` of its tile); ``row_tiles``: int64 ``[R]``,
    the row tile of each row (None: row ``r`` is tile ``r``); ``col_block``: columns per
    tile (None: one tile spans every column); ``shape``: the operand's own shape
    (``[G, N, K]`` for a weight).
    """

    data: Tensor
    scale_inv: Tensor
    row_tiles: Tensor | None
    col_block: int | None
    fmt: Fp8Format
    shape: tuple[int, ...]

    def element_scales(self) -> Tensor:
        """fp32 ``[R, C]``: each element's dequantization scale."""
        return _expand(self.scale_inv, self.row_tiles, self.col_block, self.data.shape[1])

    def dequantize(self) -> Tensor:
        """fp32 values in the operand's own shape."""
        return (self.data.float() * self.element_scales()).view(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of data and scales (what saving this operand costs)."""
        tiles = 0 if self.row_tiles is None else self.row_tiles.numel() * self.row_tiles.element_size()
        return self.data.numel() + self.scale_inv.numel() * 4 + tiles

    def to_save(self, prefix: str) -> dict[str, Tensor | None]:
        """The tensors to save for backward, named ``prefix_data`` etc. (see :meth:`from_saved`)."""
        return {
            f"{prefix}_data": self.data,
            f"{prefix}_scale": self.scale_inv,
            f"{prefix}_tiles": self.row_tiles,
        }

    def layout(self) -> tuple:
        """What :meth:`from_saved` needs besides the tensors (no tensor in it)."""
        return (self.col_block, self.fmt, self.shape)

    @staticmethod
    def from_saved(saved: dict, prefix: str, layout: tuple) -> QuantizedOperand:
        """The operand rebuilt from what :meth:`to_save` saved and :meth:`layout`."""
        col_block, fmt, shape = layout
        return QuantizedOperand(
            saved[f"{prefix}_data"], saved[f"{prefix}_scale"], saved[f"{prefix}_tiles"], col_block, fmt, shape
        )


def _expand(per_tile: Tensor, row_tiles: Tensor | None, col_block: int | None, cols: int) -> Tensor:
    rows = per_tile if row_tiles is None else per_tile.index_select(0, row_tiles)
    if col_block is None:
        return rows.expand(rows.shape[0], cols)
    # a gather, not repeat_interleave + slice (which Inductor 2.13 on CPU miscompiles here)
    column_tiles = torch.arange(cols, device=per_tile.device) // col_block
    return rows.index_select(1, column_tiles)


def group_row_tiles(
    num_rows: int, tile_rows: int | None, group_ends: Tensor | None, device: torch.device
) -> tuple[Tensor | None, int]:
    """``(row tile of each row, number of tiles)`` for tiles of ``tile_rows`` rows
    (None: a whole group) restarting at each group's first row.

    ``group_ends``: int ``[G]`` inclusive ends of the groups (None: one group of every
    row). Rows past ``group_ends[-1]`` get tiles of their own. The count is a static
    bound (some tiles may be empty).
    """
    if tile_rows == 1:
        return None, num_rows
    rows = torch.arange(num_rows, device=device)
    if group_ends is None:
        ends = torch.tensor([num_rows], device=device)
    else:
        ends = group_ends.to(device=device, dtype=torch.int64)
    num_groups = ends.shape[0]
    group = torch.searchsorted(ends, rows, right=True)  # in [0, G]; G is the tail
    if tile_rows is None:
        return group, num_groups + 1
    bounds = torch.cat([ends.new_zeros(1), ends, ends.new_full((1,), num_rows)])
    starts, sizes = bounds[:-1], bounds[1:] - bounds[:-1]
    counts = (sizes.clamp(min=0) + tile_rows - 1) // tile_rows
    first_tile = torch.cumsum(counts, 0) - counts
    tiles = first_tile[group] + (rows - starts[group]) // tile_rows
    return tiles, -(-num_rows // tile_rows) + num_groups + 1


def tile_amax(x: Tensor, row_tiles: Tensor | None, num_row_tiles: int, col_block: int | None) -> Tensor:
    """fp32 ``[row tiles, column tiles]`` amax of ``|x|``; a NaN counts as Inf (non-finite)."""
    magnitude = torch.nan_to_num(x.float().abs(), nan=float("inf"), posinf=float("inf"))
    rows, cols = magnitude.shape
    if col_block is None:
        per_row = magnitude.amax(dim=1, keepdim=True) if cols else magnitude.new_zeros(rows, 1)
    else:
        col_tiles = -(-cols // col_block)
        padded = torch.nn.functional.pad(magnitude, (0, col_tiles * col_block - cols))
        per_row = padded.view(rows, col_tiles, col_block).amax(dim=-1)
    if row_tiles is None:
        return per_row
    out = per_row.new_zeros(num_row_tiles, per_row.shape[1])
    index = row_tiles.unsqueeze(1).expand(rows, per_row.shape[1])
    return out.scatter_reduce_(0, index, per_row, "amax", include_self=True)


def quantize_2d(
    x: Tensor,
    tile: Tile,
    fmt: Fp8Format,
    recipe: Recipe,
    group_ends: Tensor | None = None,
    shape: tuple[int, ...] | None = None,
) -> QuantizedOperand:
    """Quantize ``x`` ``[R, C]`` (bf16, fp16 or fp32) in tiles ``tile`` with rows grouped by
    ``group_ends`` (int ``[G]`` inclusive ends; None: one group)."""
    tile_rows, col_block = tile
    row_tiles, num_row_tiles = group_row_tiles(x.shape[0], tile_rows, group_ends, x.device)
    amax = tile_amax(x, row_tiles, num_row_tiles, col_block)
    if recipe.e8m0_scales:
        multiplier, scale_inv = mx_scales(amax, fmt, recipe.scale_rounding)
    else:
        multiplier, scale_inv = float_scales(amax, fmt, recipe.pow2)
    data = cast_saturated(x.float() * _expand(multiplier, row_tiles, col_block, x.shape[1]), fmt)
    return QuantizedOperand(
        data, scale_inv, row_tiles, col_block, fmt, tuple(x.shape) if shape is None else shape
    )


def quantize_rows(
    x: Tensor, recipe: Recipe, kind: str, along: str, group_ends: Tensor | None
) -> QuantizedOperand:
    """Token rows ``x`` ``[M, C]`` (activations or gradients, ``kind`` ``"input"`` or ``"grad"``)
    quantized for contraction ``along`` columns or rows; rows grouped by ``group_ends``.

    Args:
        x: ``[M, C]``, bfloat16, float16 or float32.
        recipe: the recipe that gives the tile and the FP8 format.
        kind: ``"input"`` (activations) or ``"grad"`` (gradients).
        along: ``ALONG_COLUMNS`` or ``ALONG_ROWS``, the contraction direction.
        group_ends: int ``[G]``, the inclusive cumulative sums of the groups' row counts
            (group ``g`` is rows ``[group_ends[g-1], group_ends[g])``; row tiles never
            cross a group boundary), or None: one group.

    Returns:
        A :class:`~fusible_ops.recipes.QuantizedOperand`: ``data`` ``[M, C]`` in FP8 and its tile scales.
    """
    return quantize_2d(x, recipe.tile_for(kind, along), recipe.format_for(kind), recipe, group_ends)


def weight_group_ends(num_groups: int, rows_per_group: int, device: torch.device) -> Tensor:
    """Inclusive ends of a ``[G * N, K]`` weight view's groups of ``N`` rows."""
    return torch.arange(1, num_groups + 1, device=device, dtype=torch.int64) * rows_per_group


def quantize_weight(weight: Tensor, recipe: Recipe, along: str) -> QuantizedOperand:
    """A grouped weight ``[G, N, K]`` (or a dense ``[N, K]``) quantized for contraction
    ``along`` columns (in-features, forward) or rows (out-features, dgrad).

    Args:
        weight: ``[G, N, K]`` or ``[N, K]``, bfloat16, float16 or float32.
        recipe: the recipe that gives the tile and the FP8 format.
        along: ``ALONG_COLUMNS`` or ``ALONG_ROWS``, the contraction direction.

    Returns:
        A :class:`~fusible_ops.recipes.QuantizedOperand` of the ``[G * N, K]`` view, ``shape`` the weight's.
    """
    shape = tuple(weight.shape)
    groups = 1 if weight.dim() == 2 else shape[0]
    rows, cols = shape[-2], shape[-1]
    flat = weight.reshape(groups * rows, cols)
    ends = weight_group_ends(groups, rows, weight.device)
    tile = recipe.tile_for("weight", along)
    return quantize_2d(flat, tile, recipe.format_for("weight"), recipe, ends, shape)


def check_quantizable(op_name: str, dtype: torch.dtype, recipe: Recipe) -> None:
    """Recipes quantize bfloat16, float16 and float32 operands (read as fp32)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"{op_name}: recipe {recipe!r} quantizes bfloat16, float16 or float32 operands, not {dtype}"
        )


#: ``op_kwargs`` key of a GroupedLinear (fc1 of the expert block): its input already
#: quantized, as an expert-parallel dispatch that sent FP8 rows and their scales has it
QUANTIZED_INPUT_KEY = "quantized_input"


def quantize_input(x: Tensor, recipe: Recipe, split_sizes) -> QuantizedOperand:
    """Token rows ``x`` ``[M, K]`` quantized as a GroupedLinear's forward quantizes its
    input under ``recipe`` (along in-features, row tiles restarting at each group):
    what ``op_kwargs={i: {QUANTIZED_INPUT_KEY: ...}}`` takes.

    Args:
        x: ``[M, K]`` token rows sorted by group, bfloat16, float16 or float32.
        recipe: the recipe the GroupedLinear will run under.
        split_sizes: rows per group, a list of ints or an int tensor ``[G]``.
    """
    sizes = torch.as_tensor(split_sizes, dtype=torch.int64, device=x.device)
    return quantize_rows(x, recipe, "input", "columns", torch.cumsum(sizes, 0))


def check_quantized_input(
    op_name: str, operand: object, recipe: Recipe | None, x: Tensor, group_ends
) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming ``op_name`` unless ``operand`` is what
    :func:`quantize_input` makes of rows shaped like ``x`` ``[M, K]`` under ``recipe``
    (its values are the caller's: they are not compared with ``x``'s)."""
    where = f"{op_name}: op_kwargs[{QUANTIZED_INPUT_KEY!r}]"
    if recipe is None:
        raise ValueError(f"{where} is given but no low-precision recipe is in force")
    if not isinstance(operand, QuantizedOperand):
        raise TypeError(
            f"{where} must be a fusible_ops.recipes.QuantizedOperand, got {type(operand).__name__}"
        )
    fmt = recipe.format_for("input")
    tile_rows, col_block = recipe.tile_for("input", "columns")
    rows, cols = x.shape
    expected_tiles = group_row_tiles(rows, tile_rows, group_ends, x.device)
    col_tiles = 1 if col_block is None else -(-cols // col_block)
    problems = []
    if tuple(operand.shape) != (rows, cols) or tuple(operand.data.shape) != (rows, cols):
        problems.append(f"shape {tuple(operand.data.shape)}, the input's is {(rows, cols)}")
    if operand.fmt != fmt or operand.data.dtype != fmt.dtype:
        problems.append(f"format {operand.data.dtype}, recipe {recipe!r} quantizes inputs to {fmt.dtype}")
    if operand.col_block != col_block:
        problems.append(f"column tiles of {operand.col_block}, recipe {recipe!r} uses {col_block}")
    if operand.data.device != x.device or operand.scale_inv.device != x.device:
        problems.append(f"on {operand.data.device}, the input is on {x.device}")
    if operand.scale_inv.dtype != torch.float32 or tuple(operand.scale_inv.shape) != (
        expected_tiles[1],
        col_tiles,
    ):
        problems.append(
            f"scales {operand.scale_inv.dtype} {tuple(operand.scale_inv.shape)}, expected float32 "
            f"{(expected_tiles[1], col_tiles)}"
        )
    elif (operand.row_tiles is None) != (expected_tiles[0] is None) or (
        operand.row_tiles is not None and not torch.equal(operand.row_tiles, expected_tiles[0])
    ):
        problems.append("row tiles that do not follow this call's split sizes")
    if problems:
        raise ValueError(f"{where} does not match this call: {'; '.join(problems)}")
