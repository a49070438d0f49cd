"""The rows a row kernel's program takes (`row_block`): norms, softmaxes and reductions work on `ROWS` rows of a
2-D input at once, the program's block of them, masked past the last row."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_block(n_rows, ROWS: tl.constexpr):
    """The program's rows (int64 indices) and which of them exist."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    return rows, rows < n_rows
