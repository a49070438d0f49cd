"""Launch settings shared by the kernels: block sizes and warp counts from the shape, as Liger-Kernel's
`calculate_settings` does, and the number of programs that fill the device.

The settings depend only on the shape and dtype, never on where the kernel runs, so a launch under the
interpreter uses exactly the specialisation that a GPU compiles (the CPU compile test relies on this).
"""

from __future__ import annotations

import functools

import torch
import triton

# One program holds a whole row in registers up to this many columns; longer rows are walked in blocks.
MAX_ROW_BLOCK = 8192
# Rows of a narrow-row kernel that one program takes together (a 2-D block of ROWS x columns).
ROW_TILE_ELEMENTS = 2048
# Elements per program of the elementwise kernels.
POINTWISE_BLOCK = 1024


def warps(block: int) -> int:
    """Warps for a program that reduces or streams `block` elements at once."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def row_settings(n_cols: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps) for a row-wise kernel over rows of `n_cols` elements.

    A row that fits MAX_ROW_BLOCK is held whole (BLOCK >= n_cols); narrow rows are stacked ROWS at a time
    so that a program still moves a useful amount of data; longer rows are walked in MAX_ROW_BLOCK steps
    (BLOCK < n_cols, ROWS = 1).
    """
    block = triton.next_power_of_2(max(1, n_cols))
    if block > MAX_ROW_BLOCK:
        return 1, MAX_ROW_BLOCK, warps(MAX_ROW_BLOCK)
    rows = max(1, min(16, ROW_TILE_ELEMENTS // block))
    return rows, block, warps(rows * block)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs(device: torch.device) -> int:
    """Programs that keep every multiprocessor busy (a small fixed number where kernels are interpreted)."""
    if device.type == "cuda":
        return 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4
