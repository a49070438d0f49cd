"""`python -m ops list`: the ATen ops `ops.aten` routes (our op, its ATen overloads, forward/backward, the dtypes
it computes itself: a call in another is PyTorch's)
and their count, read from `ops.aten_routes` without loading torch or triton."""

from __future__ import annotations

import sys

from ops.catalog import rows, summary


def main(argv: list[str]) -> int:
    if argv == ["list"]:
        print(f"{'op':<28}{'overloads':>10}  {'routes':<9}{'dtypes':<56}aten")
        for row in rows():
            print(f"{row.op:<28}{len(row.overloads):>10}  {row.routes:<9}{row.dtypes:<56}{', '.join(row.overloads)}")
        print(summary())
        return 0
    print("usage: python -m ops list", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
