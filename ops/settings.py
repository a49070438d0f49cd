"""Launch settings shared by the kernels: block sizes and warp counts from the shape, as Liger-Kernel's
`calculate_settings` does, the matmul's tiles, and the number of programs that fill the device. Importing it
installs `ops.interpreter`'s corrections (under TRITON_INTERPRET=1), before any kernel launches.

The settings depend only on the shape and dtype, never on where the kernel runs, so a launch under the
interpreter uses exactly the specialisation that a GPU compiles (the CPU compile test relies on this).
"""

from __future__ import annotations

import functools

import torch
import triton

from ops import interpreter

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


def matmul_settings(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """The matmul kernel's tiles, warps and pipeline depth from the shape and dtype (the Triton matmul
    tutorial's choices for Hopper and Ampere: 128x256x64 for large 16-bit products, 128x128x32 for fp32),
    smaller tiles for small products. The largest fits sm_80's shared memory (3 stages of 48 KiB)."""
    wide = dtype.itemsize == 2
    if min(m, n) >= 1024:
        bm, bn, bk = (128, 256, 64) if wide else (128, 128, 32)
        return {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    bm = min(128, max(16, triton.next_power_of_2(m)))
    bn = min(128, max(16, triton.next_power_of_2(n)))
    bk = min(64 if wide else 32, max(16, triton.next_power_of_2(k)))
    return {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs(device: torch.device) -> int:
    """Programs that keep every multiprocessor busy (a small fixed number where kernels are interpreted)."""
    if device.type == "cuda":
        return 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


# Every kernel module takes its launch settings from here: importing it readies the interpreter for them.
interpreter.install()
