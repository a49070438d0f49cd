"""bench/gpu_report.py reads a bench/gpu_check.sh report back into the issue's targets: the kernel
table's rows (Liger and FlagGems columns included) and the end-to-end tokens/s lines, as the scripts
print them (their own header and row formats, kept in bench/kernels.py and bench/e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.bench_script import load

REPO = Path(__file__).resolve().parents[2]
gpu_report, e2e, kernels = load("gpu_report"), load("e2e"), load("kernels")

nan = float("nan")
# A report as bench/gpu_check.sh writes it: the scripts' own header and rows, with made-up numbers.
ROWS = [kernels.row("rms_norm", "bf16", 0.1, 0.3, 0.15, 0.12, 0.2, 0.25, 1000, 0.1, 0.2) + "  ok [max err: ours 0.01]",
        kernels.row("silu", "bf16", 0.5, 0.4, nan, nan, 0.45, 0.25, 1000, 0.1, 0.2) + "  ok",
        kernels.row("mm", "fp32", 1.0, 1.0, nan, nan, nan, 0.25, 1000, 0.1, 0.2),
        kernels.row("scaled_dot_product_attention", "bf16", 10.0, 9.5, nan, nan, 12.0, 0.02, 100, 0.1, 0.2)]
REPORT = "\n".join([
    "# bench/gpu_check.sh on gpu-1, 2026-12-01T20:00:00Z", "NVIDIA H200, 570.86, 143771 MiB", "",
    "## python bench/kernels.py --check (Llama-3-8B shapes, 4096 tokens)",
    "NVIDIA H200: copy bandwidth 4000 GB/s; 4096 tokens (attention 8192), forward + backward",
    kernels.HEADER + "  check", *ROWS, "",
    "## end to end (python -m trainer): tokens/s and MFU",
    "model   kernels     tokens/s     MFU",
    "1b      torch          40000   30.0%  (mean of 8 logged steps)",
    "1b      triton         45000   33.0%  (mean of 8 logged steps)",
    "1b      triton-cublas  43000   31.5%  (mean of 8 logged steps)", "",
    "## python bench/e2e.py", e2e.line("model", "variant", "tokens/s"),
    e2e.line("1b", "gems", "38000"), e2e.line("1b", "hf-liger", "skipped", "liger-kernel is not installed"),
])


def test_the_report_reads_back_into_targets(tmp_path):
    ops, e2e = gpu_report.parse(REPORT)
    assert [(r.op, r.dtype) for r in ops] == [("rms_norm", "bf16"), ("silu", "bf16"), ("mm", "fp32"),
                                              ("scaled_dot_product_attention", "bf16")]
    assert ops[0].best_peer_ms == 0.120 and ops[1].liger_ms != ops[1].liger_ms  # NaN: Liger has no silu
    assert e2e == {("1b", "torch"): 40000.0, ("1b", "triton"): 45000.0, ("1b", "triton-cublas"): 43000.0,
                   ("1b", "gems"): 38000.0}
    rows = {target: (measured, verdict) for target, measured, verdict in gpu_report.targets(ops, e2e)}
    assert rows["rms_norm bf16: >= 1.0x eager"] == ("3.00x", "met")
    assert rows["rms_norm bf16: >= the faster peer"] == ("1.20x", "met")
    assert rows["silu bf16: >= 1.0x eager"] == ("0.80x", "MISSED")
    assert rows["silu bf16: >= the faster peer"] == ("0.90x", "MISSED")
    assert "mm fp32: >= the faster peer" not in rows  # neither peer measured it
    assert rows["scaled_dot_product_attention bf16: >= 0.9x flash SDPA"] == ("0.95x", "met")
    assert rows["model=1b kernels=triton: >= 1.1x kernels=torch"] == ("1.12x", "met")
    # Which default is faster: ours (kernels=triton) or cuBLAS's matmuls (kernels.exclude=[mm,addmm,bmm]).
    assert rows["model=1b kernels=triton: our matmuls >= cuBLAS's (kernels.exclude=[mm,addmm,bmm])"] == ("1.05x", "met")

    path = tmp_path / "gpu_check.txt"
    path.write_text(REPORT)
    run = subprocess.run([sys.executable, "bench/gpu_report.py", str(path)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "8 targets: 6 met, 2 missed, 0 not measured"


def test_an_empty_report_measures_nothing_and_a_missing_one_is_refused(tmp_path):
    rows = gpu_report.targets(*gpu_report.parse("## pytest tests/ops\n5 passed\n"))
    assert [verdict for _, _, verdict in rows] == ["not measured"] * 3
    run = subprocess.run([sys.executable, "bench/gpu_report.py", str(tmp_path / "none.txt")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "cannot read the report" in run.stderr and run.stdout == ""
