"""`runtime.nnodes` read as the launchers and the trainer's config read it: `N` nodes, or torchrun's elastic
range `MIN:MAX`."""

from __future__ import annotations


def node_range(nnodes: int | str) -> tuple[int, int]:
    """`runtime.nnodes` as (fewest, most) nodes: `N` is a fixed size (N, N), `MIN:MAX` torchrun's elastic
    range. Raises ValueError naming what is allowed."""
    text = str(nnodes).strip()
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError("must be a node count N, or MIN:MAX (an elastic range, such as 1:4)")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        raise ValueError("needs 1 <= MIN <= MAX")
    return low, high
