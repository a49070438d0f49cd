"""bench/kernels.py --check and bench/gpu_check.sh's report, without a GPU.

The kernel cases (at 2 tokens, so that Triton's interpreter runs them) go through `check`, which compares
ours, eager and each peer with a wider-precision reference, prints each one's largest error, names a
peer that fails, and calls ours WRONG when it strays further from the reference than eager does.
Liger-Kernel's functions run as they are where it is installed (under the interpreter here); FlagGems,
which refuses to import without a GPU, is stood in for by eager under a context, as its `use_gems()`
runs it; and two peers of known fault: one off by 1e-2, one that raises. Then a trainer run's metrics
become the report's end-to-end line, which bench/gpu_report.py reads back.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench_script import load
from tests.ops.conftest import DEVICE

REPO = Path(__file__).resolve().parents[2]


bench = load("kernels")

# Liger's rotary kernel (which runs under the interpreter) and the routed elementwise ops; the rest are
# slow interpreted at these shapes (4096-wide rows) and have their own tests.
SMALL = ("rotary_embedding", "add", "mul")


@pytest.mark.timeout(300)
def test_the_bench_cases_pass_the_check_beside_their_peers():
    entered = []

    @contextlib.contextmanager
    def gems():  # FlagGems' use_gems() stand-in: the eager reference, run inside the peer's context
        entered.append(True)
        yield

    def off_by_a_hundredth(*inputs):
        return eager(*inputs) + 1e-2

    from ops.aten import calls

    seen, with_liger = set(), set()
    routed = calls["add.Tensor"], calls["mul.Tensor"]
    for name, make, ours, eager, liger in bench.cases(2, torch.float32, attn_seq=4, device=DEVICE):
        if name not in SMALL:
            continue
        seen.add(name)
        peers = {"gems": (eager, gems), "off": (off_by_a_hundredth, contextlib.nullcontext),
                 "broken": (lambda *inputs: 1 / 0, contextlib.nullcontext)}
        if liger is not None:
            peers["liger"] = (liger, contextlib.nullcontext)
        verdict = bench.check(ours, eager, make(), peers, bench.ours_context(name))
        assert verdict.startswith("ok [max err: ours "), f"{name}: {verdict}"
        errors = dict(re.findall(r"(\w+) ([0-9.e+-]+)", verdict.split("[max err: ")[1]))
        assert float(errors["ours"]) < 1e-4 and float(errors["gems"]) == float(errors["eager"]), verdict
        assert 1e-2 * 0.99 <= float(errors["off"]) <= 1e-2 * 1.01, verdict
        assert "broken failed (ZeroDivisionError)" in verdict
        if liger is not None:  # Liger's own kernels, at most as far from the reference as ours may be
            assert "liger failed" in verdict or float(errors["liger"]) < 1e-3, verdict
            with_liger.add(name)
    assert seen == set(SMALL) and len(entered) == len(SMALL)
    assert calls["add.Tensor"] > routed[0] and calls["mul.Tensor"] > routed[1]  # ours ran in our kernels
    if importlib.util.find_spec("liger_kernel"):  # where Liger has the op, its column is checked
        assert with_liger == {"rotary_embedding"}


def test_check_calls_a_kernel_wrong_when_it_strays_further_than_eager():
    x, w = (torch.randn(4, 8, dtype=torch.bfloat16, device=DEVICE).requires_grad_() for _ in range(2))
    verdict = bench.check(lambda a, b: torch.mul(a, b) * 1.05, torch.mul, [x, w], {})
    assert verdict.startswith("WRONG output: ours "), verdict
    assert "grad of input 0: ours" in verdict and "grad of input 1: ours" in verdict


def test_a_trainer_runs_metrics_become_the_reports_end_to_end_line(tmp_path):
    """bench/gpu_check.sh turns each `python -m trainer` run into one line (bench/gpu_report.py --run);
    the report's reader takes its tokens/s back, and a run that logged nothing reads as not measured."""
    gpu_report = load("gpu_report")
    rows = [{"step": i + 1, "loss": 5.0, "tokens_per_s": tok, "mfu": mfu}
            for i, (tok, mfu) in enumerate([(100, 0.1), (200, 0.2), (300, 0.3), (500, 0.5)])]
    run = tmp_path / "1b-triton"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"eval_loss": 4.0}\n')
    line = subprocess.run([sys.executable, "bench/gpu_report.py", "--run", str(run), "1b", "triton"], cwd=REPO,
                          capture_output=True, text=True, timeout=60).stdout.strip()
    assert line == "1b      triton           400   40.0%  (mean of 2 logged steps)"  # the second half
    empty = tmp_path / "1b-torch"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    failed = gpu_report.run_line(str(empty), "1b", "torch")
    assert failed.startswith("1b      torch         failed")
    _, e2e = gpu_report.parse("\n".join([line, failed]))
    assert e2e == {("1b", "triton"): 400.0}
    verdicts = {target: verdict for target, _, verdict in gpu_report.targets([], e2e)}
    assert verdicts["model=1b kernels=triton: >= 1.1x kernels=torch"] == "not measured"


def test_the_gpu_check_script_parses_and_reports_through_gpu_report():
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", "bench/gpu_check.sh"], cwd=REPO, timeout=60).returncode == 0
    assert 'python3 bench/gpu_report.py --run "$dir" "$model" "$label"' in script
    # kernels=triton as it runs by default, and with cuBLAS's matmuls: one lease tells which is faster.
    assert "e2e 1b triton kernels=triton" in script
    assert "e2e 1b triton-cublas kernels=triton 'kernels.exclude=[mm,addmm,bmm]'" in script
    assert 'python3 bench/gpu_report.py "$report"' in script and "bench/kernels.py --check" in script
