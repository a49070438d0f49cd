"""`python -m ops list`: the ATen ops `ops.aten` routes (our op, its ATen overloads, forward/backward, dtypes)
and their count; `python -m ops names`: the same names as trainer/config/aten_names.py holds them (that file
is this command's output, so the config, which imports no torch, knows them)."""

from __future__ import annotations

import sys

from ops.aten import TABLE
from ops.catalog import rows, summary


def _names() -> str:
    publics = sorted({public for public, _, _ in TABLE})
    overloads = sorted({aten for _, aten, _ in TABLE} - set(publics))
    lines = ['"""The ATen ops `ops.enable()` routes (written by `python -m ops names`: do not edit; a test checks',
             'it is current). No torch here: trainer/config reads them."""', "",
             "# By our name (each with its backward, in-place and out= forms)...", "ATEN_OPS = ("]
    lines += [f"    {name!r}," for name in publics]
    lines += [")", "# ... or by ATen's, one overload each.", "ATEN_OVERLOADS = ("]
    lines += [f"    {name!r}," for name in overloads] + [")", ""]
    return "\n".join(lines).replace("'", '"')


def main(argv: list[str]) -> int:
    if argv == ["list"]:
        print(f"{'op':<28}{'overloads':>10}  {'routes':<9}{'dtypes':<30}aten")
        for row in rows():
            print(f"{row.op:<28}{len(row.overloads):>10}  {row.routes:<9}{row.dtypes:<30}{', '.join(row.overloads)}")
        print(summary())
        return 0
    if argv == ["names"]:
        print(_names(), end="")
        return 0
    print("usage: python -m ops list | names", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
