"""The kernel coverage of a training step (bench/coverage.py) does not fall: one step of a one-layer
`model=debug` at 8 tokens under Triton's interpreter (or compiled on a GPU), traced at the ATen level."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# bench/coverage.py by its path: the name `coverage` is coverage.py's, which pytest plugins import.
_spec = importlib.util.spec_from_file_location("bench_coverage", REPO / "bench" / "coverage.py")
coverage = sys.modules["bench_coverage"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)

# What the step runs in ours today: a change that sends any of it back to torch fails here.
ROUTED = {"mm", "embedding", "embedding_dense_backward", "add.Tensor", "mul.Tensor", "div.Tensor", "sum",
          "sum.dim_IntList"}
# The model's fused modules and the optimizer, which never reach ATen: their kernels must launch.
KERNELS = {"_norm_fwd", "_norm_bwd", "_rope", "_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_pw_TT_o1_r1",
           "_pw_TTT_o2_r1", "_ce_loss", "_ce_grad", "_matmul", "_embedding_fwd", "_embedding_bwd", "_adamw"}


@pytest.fixture(scope="module")
def step():
    return coverage.trace_step(["model=debug", "model.n_layers=1"], seq=8, batch=1)


@pytest.mark.timeout(300)
def test_a_training_step_runs_in_our_kernels(step):
    rows, launches = step
    ours = {name for name, row in rows.items() if row.where == "ours"}
    assert ours >= ROUTED, f"back to torch: {sorted(ROUTED - ours)}"
    assert set(launches) >= KERNELS, f"not launched: {sorted(KERNELS - set(launches))}"
    assert launches["_adamw"] == 12  # one per parameter of one layer, the embedding and the norm
    s = coverage.summary(rows)
    assert s["ours_calls"] / s["calls"] >= 0.8 and s["ours_bytes"] / s["bytes"] >= 0.85, s
    # Views move nothing; every op the step calls has a row, with its calls.
    assert rows["view"].where == "excluded: view" and rows["view"].bytes == 0
    assert rows["mm"].calls >= 7 * 2 and rows["mm"].bytes > 0  # seven linears, forward and backward
    text = coverage.table(rows, launches)
    assert "excluded: allocation" in text and "computing ops in ours: " in text and "_attn_fwd" in text


def test_coverage_refuses_bad_sizes_before_any_work():
    run = subprocess.run([sys.executable, "bench/coverage.py", "--seq", "0"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "--seq 0 --batch 2: both must be at least 1" in run.stderr
