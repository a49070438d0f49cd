"""The issue's speed targets, read back from a `bench/gpu_check.sh` report: one line per target with the
measured figure and `met`, `MISSED` or `not measured`.

Targets: every op of bench/kernels.py at least 1.0x eager and at least as fast as the faster of Liger
and FlagGems where they have it (their column is a number); attention (bf16) at least 0.9x PyTorch's
flash SDPA forward + backward; `kernels=triton` at least 1.10x `kernels=torch` end to end on model=1b
(the worker's lines); and which default of kernels=triton is faster on model=1b: our matmuls (`triton`)
or cuBLAS's (`triton-cublas`, kernels.exclude=[mm,addmm,bmm]).

    python bench/gpu_report.py <gpu_check.txt>
    python bench/gpu_report.py --run <run dir> <model> <kernels>     one end-to-end line of the report
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
from trainjob.run_files import read_metrics  # noqa: E402

DTYPES = ("bf16", "fp32", "fp16")
ATTENTION = "scaled_dot_product_attention"
OP_TARGET, ATTENTION_TARGET, E2E_TARGET = 1.0, 0.9, 1.10


@dataclasses.dataclass
class OpRow:
    op: str
    dtype: str
    ours_ms: float
    eager_ms: float
    liger_ms: float
    gems_ms: float

    @property
    def best_peer_ms(self) -> float:
        peers = [t for t in (self.liger_ms, self.gems_ms) if not math.isnan(t)]
        return min(peers) if peers else math.nan


def parse(text: str) -> tuple[list[OpRow], dict[tuple[str, str], float]]:
    """The kernel table's rows and bench/e2e.py's tokens/s by (model, variant), from a report's text."""
    ops, e2e = [], {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 7 and fields[1] in DTYPES:
            try:
                ours, eager, _compiled, liger, gems = (float(f) for f in fields[2:7])
            except ValueError:
                continue
            ops.append(OpRow(fields[0], fields[1], ours, eager, liger, gems))
        elif len(fields) >= 3 and fields[1] in ("torch", "triton", "triton-cublas", "gems", "hf", "hf-liger"):
            try:
                e2e[(fields[0], fields[1])] = float(fields[2])
            except ValueError:
                continue  # "skipped" or "failed"
    return ops, e2e


def targets(ops: list[OpRow], e2e: dict[tuple[str, str], float]) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each target the issue sets."""
    def verdict(value: float, floor: float) -> str:
        return "not measured" if math.isnan(value) else ("met" if value >= floor else "MISSED")

    lines = []
    for row in ops:
        name = f"{row.op} {row.dtype}"
        vs_eager = row.eager_ms / row.ours_ms
        if row.op == ATTENTION:
            lines.append((f"{name}: >= {ATTENTION_TARGET}x flash SDPA", f"{vs_eager:.2f}x",
                          verdict(vs_eager, ATTENTION_TARGET)))
            continue
        lines.append((f"{name}: >= {OP_TARGET}x eager", f"{vs_eager:.2f}x", verdict(vs_eager, OP_TARGET)))
        if not math.isnan(row.best_peer_ms):
            vs_peer = row.best_peer_ms / row.ours_ms
            lines.append((f"{name}: >= the faster peer", f"{vs_peer:.2f}x", verdict(vs_peer, OP_TARGET)))
    if not any(row.op == ATTENTION for row in ops):
        lines.append((f"{ATTENTION}: >= {ATTENTION_TARGET}x flash SDPA", "-", "not measured"))
    torch_rate, triton_rate = e2e.get(("1b", "torch"), math.nan), e2e.get(("1b", "triton"), math.nan)
    ratio = triton_rate / torch_rate
    lines.append((f"model=1b kernels=triton: >= {E2E_TARGET}x kernels=torch",
                  "-" if math.isnan(ratio) else f"{ratio:.2f}x", verdict(ratio, E2E_TARGET)))
    matmuls = triton_rate / e2e.get(("1b", "triton-cublas"), math.nan)
    lines.append(("model=1b kernels=triton: our matmuls >= cuBLAS's (kernels.exclude=[mm,addmm,bmm])",
                  "-" if math.isnan(matmuls) else f"{matmuls:.2f}x", verdict(matmuls, 1.0)))
    return lines


def run_line(run_dir: str, model: str, kernels: str) -> str:
    """The report's end-to-end line of one `python -m trainer` run: tokens/s and MFU, the means over the
    second half of its logged steps (compiled and warmed up), from the run's metrics.jsonl."""
    rows = [row for row in read_metrics(run_dir) if "tokens_per_s" in row]
    if not rows:
        return f"{model:<8}{kernels:<8}{'failed':>12}  (no step logged tokens/s in {run_dir})"
    steady = rows[len(rows) // 2:]
    tokens = sum(r["tokens_per_s"] for r in steady) / len(steady)
    mfu = sum(r.get("mfu", 0.0) for r in steady) / len(steady)
    return f"{model:<8}{kernels:<8}{tokens:>12.0f}{mfu:>8.1%}  (mean of {len(steady)} logged steps)"


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--run":
        print(run_line(*sys.argv[2:]))
        return
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/gpu_report.py <gpu_check.txt> | --run <run dir> <model> <kernels>")
    try:
        with open(sys.argv[1]) as f:
            text = f.read()
    except OSError as e:
        print(f"bench/gpu_report.py: cannot read the report {sys.argv[1]}: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    rows = targets(*parse(text))
    width = max(len(t) for t, _, _ in rows)
    for target, measured, result in rows:
        print(f"{target:<{width}}  {measured:>7}  {result}")
    missed = sum(r == "MISSED" for _, _, r in rows)
    unmeasured = sum(r == "not measured" for _, _, r in rows)
    print(f"{len(rows)} targets: {len(rows) - missed - unmeasured} met, {missed} missed, {unmeasured} not measured")


if __name__ == "__main__":
    main()
