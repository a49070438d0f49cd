"""`python -m ops list`, as a terminal prints it: at least 200 public ATen ops, and each row's dtypes are what
its kernels take (a backward op computes a gradient: floating dtypes only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ops_list_prints_each_ops_routes_and_dtypes():
    out = subprocess.run([sys.executable, "-m", "ops", "list"], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=120).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    assert len(rows) >= 200 and out.splitlines()[-1].startswith(f"{len(rows)} public ATen ops routed")
    floats, every = "fp32,bf16,fp16", "fp32,bf16,fp16,int64,int32,int16,int8,uint8,bool"
    assert rows["native_layer_norm_backward"][2:4] == ["backward", floats]
    backward = {op: row[3] for op, row in rows.items() if row[2] == "backward"}
    assert {"native_layer_norm_backward", "select_backward", "threshold_backward"} <= set(backward)
    assert set(backward.values()) == {floats}, {op: d for op, d in backward.items() if d != floats}
    assert rows["add"][3] == every and rows["where"][3] == every and rows["native_layer_norm"][3] == floats
    assert rows["mm"][3] == floats and rows["hardtanh"][3] == floats
    assert rows["copy"][3] == every + ",fp64"
