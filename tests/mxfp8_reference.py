"""Test-side decoders of the cuDNN adapter's MXFP8 layouts, written from the frontend's docs.

The adapter only encodes (``pack_scales``, ``mxfp8_quantize``); these read its output
back, so the tests check the encoding against the documented layout, not against itself.
"""

from __future__ import annotations

import torch

MX_BLOCK = 32  # values per E8M0 scale along K
TILE_ROWS, TILE_COLS = 128, 4  # one 512-byte scale tile


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def mx_scale_shape(rows: int, cols: int, groups: int = 1) -> tuple[int, ...]:
    """The frontend's logical 6-D scale-factor shape ``(32, 4, rest_m, 4, rest_k, G)``."""
    return (32, 4, _ceil_div(rows, TILE_ROWS), 4, _ceil_div(_ceil_div(cols, MX_BLOCK), TILE_COLS), groups)


def logical_scale_view(packed: torch.Tensor) -> torch.Tensor:
    """The logical ``(32, 4, rest_m, 4, rest_k, G)`` strided view of a packed ``(G, rest_m, rest_k, 32, 4, 4)`` buffer."""
    groups, rest_m, rest_k = packed.shape[:3]
    return packed.reshape(groups, rest_m, rest_k, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)


def unpack_scales(packed: torch.Tensor, rows: int, cols_sf: int) -> torch.Tensor:
    """``[G, rows, cols_sf]`` exponents from a packed buffer: row ``r`` of a 128-row tile
    sits at ``(r % 32, r // 32)``, column ``c`` of a 4-column tile at slot ``c``."""
    groups, rest_m, rest_k = packed.shape[:3]
    out = torch.empty(groups, rest_m * TILE_ROWS, rest_k * TILE_COLS, dtype=packed.dtype)
    tiles = packed.reshape(groups, rest_m, rest_k, 32, 4, 4)
    for r in range(TILE_ROWS):
        for c in range(TILE_COLS):
            out[:, r::TILE_ROWS, c::TILE_COLS] = tiles[:, :, :, r % 32, r // 32, c]
    return out[:, :rows, :cols_sf]


def mxfp8_dequantize(q: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """float32 values: each block of 32 along the last dim times ``2 ** (exponent - 127)``."""
    scale = torch.exp2(exponents.float() - 127.0).repeat_interleave(MX_BLOCK, dim=-1)
    return q.float() * scale[..., : q.shape[-1]]
