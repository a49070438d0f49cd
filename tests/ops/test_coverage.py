"""The kernel coverage of a training step (bench/coverage.py) does not fall: one step of a one-layer
`model=debug`, and of a tiny Hugging Face model (`model=hf`), at 8 tokens under Triton's interpreter (or
compiled on a GPU), traced at the ATen level: every op that computes runs in ours."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# bench/coverage.py by its path: the name `coverage` is coverage.py's, which pytest plugins import.
_spec = importlib.util.spec_from_file_location("bench_coverage", REPO / "bench" / "coverage.py")
coverage = sys.modules["bench_coverage"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)

# Ops the step must call, in ours (a trace that lost them would pass the 100% below vacuously).
ROUTED = {"mm", "mm.out", "addmm_", "embedding", "embedding_dense_backward", "add.Tensor", "mul.Tensor",
          "mul_.Tensor", "div.Tensor", "ne.Scalar", "clamp", "reciprocal", "sum", "sum.dim_IntList"}
# The model's fused modules and the optimizer, which never reach ATen: their kernels must launch.
KERNELS = {"_norm_fwd", "_norm_bwd", "_rope", "_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_pw_TT_o1_r1",
           "_pw_TTT_o2_r1", "_ce_loss", "_ce_grad", "_matmul", "_embedding_fwd", "_embedding_bwd", "_adamw"}


@pytest.fixture(scope="module")
def step():
    return coverage.trace_step(["model=debug", "model.n_layers=1"], seq=8, batch=1)


def _all_ours(rows):
    """Every op that computes ran in ours: torch eager only for the excluded (views, allocations, copies)."""
    eager = sorted(name for name, row in rows.items() if row.where == "torch")
    assert not eager, f"computing ops in torch eager: {eager}"
    s = coverage.summary(rows)
    assert s["ours_ops"] == s["ops"] and s["ours_calls"] == s["calls"] and s["ours_bytes"] == s["bytes"], s


@pytest.mark.timeout(300)
def test_a_training_step_runs_in_our_kernels(step):
    rows, launches = step
    ours = {name for name, row in rows.items() if row.where == "ours"}
    assert ours >= ROUTED, f"back to torch: {sorted(ROUTED - ours)}"
    _all_ours(rows)
    assert set(launches) >= KERNELS, f"not launched: {sorted(KERNELS - set(launches))}"
    assert launches["_adamw"] == 12  # one per parameter of one layer, the embedding and the norm
    # Views move nothing; every op the step calls has a row, with its calls.
    assert rows["view"].where == "excluded: view" and rows["view"].bytes == 0
    assert rows["mm"].calls >= 7 * 2 and rows["mm"].bytes > 0  # seven linears, forward and backward
    text = coverage.table(rows, launches)
    assert "computing ops in ours: 14 of 14; calls 45 of 45 (100%); bytes 100%" in text, text
    assert "excluded: allocation" in text and "allocation: new memory" in text and "_attn_fwd" in text


@pytest.mark.timeout(300)
def test_a_hugging_face_models_step_runs_in_our_kernels(tmp_path):
    """model=hf shapes: a tiny Qwen2 directory (q/k/v biases: addmm; tied embeddings)."""
    from tests.trainer.hf_models import make_qwen2

    rows, launches = coverage.trace_step(["model=hf", f"model.path={make_qwen2(str(tmp_path))}"], seq=8, batch=1)
    _all_ours(rows)
    assert rows["addmm"].where == "ours" and rows["addmm"].calls == 2 * 3  # q, k, v of two layers
    assert "_attn_bwd_dq" in launches


def test_coverage_refuses_bad_sizes_before_any_work(monkeypatch, capsys):
    """In this process (bench/coverage.py's main, as its command line runs it): exit 2 and one line."""
    monkeypatch.setattr(sys, "argv", ["bench/coverage.py", "--seq", "0"])
    with pytest.raises(SystemExit) as exit_:
        coverage.main()
    assert exit_.value.code == 2 and "--seq 0 --batch 2: both must be at least 1" in capsys.readouterr().err
