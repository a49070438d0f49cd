"""The same job under each runtime on this machine: tokens/s once started and the seconds from `python -m trainer`
to the first step, for torch-distributed (torchrun) and mpi (OpenMPI's mpirun) under `--strategy`, and
deepspeed-distributed (mpirun, the DeepSpeed engine) at each ZeRO stage.

World size 2 (2 processes on one node), the `debug` model, the same seed and data. tokens/s is the median, over
the steps after `--warmup`, of the per-step figure the worker logs (robust on a busy, shared machine); the time
to the first step runs from starting `python -m trainer` until its first metrics line is on disk (the agent,
the ranks' start, the process group, the model build and the first step). The runtimes alternate, `--rounds`
times, on one warm corpus cache. Targets: mpi >= 0.95x torchrun's tokens/s; deepspeed's ZeRO-1 >= 0.9x ddp's.

    python bench/runtimes.py [--steps 30] [--warmup 5] [--rounds 2] [--strategy ddp] [override ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
from trainjob.run_files import RunDir  # noqa: E402

# Each row's overrides; those without a strategy run `--strategy`.
RUNTIMES = {"torch-distributed": ["runtime=torch-distributed"], "mpi": ["runtime=mpi"],
            **{f"deepspeed zero-{z}": ["runtime=deepspeed-distributed", "strategy=deepspeed",
                                       f"strategy.zero_stage={z}"] for z in (1, 2, 3)}}


def measure(overrides: list[str], cache: str, run_dir: str, warmup: int) -> dict:
    """One run of `python -m trainer *overrides` into `run_dir`: its median tokens/s after `warmup` steps and the
    seconds to its first metrics line."""
    metrics = RunDir.of(run_dir).metrics
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            env={**os.environ, "TRAINJOB_CACHE": cache, "PYTHONPATH": REPO},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            first = time.perf_counter() - start
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"{overrides}: exit code {proc.returncode}: {proc.stderr.read()[-2000:]}")
    with open(metrics) as f:
        rates = [r["tokens_per_s"] for r in map(json.loads, f) if "tokens_per_s" in r and r["step"] > warmup]
    return {"tok_s": statistics.median(rates), "first_step_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("overrides", nargs="*", help="more trainer overrides, for every runtime")
    args = parser.parse_args()
    common = ["runtime.nproc_per_node=2", f"train.max_steps={args.steps}",
              "train.log_every=1", "train.eval_every=100000", "train.checkpoint_every=100000", "train.progress=false",
              *args.overrides]
    results: dict[str, list[dict]] = {name: [] for name in RUNTIMES}
    with tempfile.TemporaryDirectory(prefix="bench-runtimes-") as top:
        cache = os.path.join(top, "cache")
        for r in range(args.rounds):
            for name, runtime in RUNTIMES.items():
                strategy = [] if any(o.startswith("strategy=") for o in runtime) else [f"strategy={args.strategy}"]
                results[name].append(measure([*runtime, *strategy, *common], cache, os.path.join(top, f"{name}-{r}"),
                                             args.warmup))
    base = statistics.mean(x["tok_s"] for x in results["torch-distributed"])
    print(f"\ndebug model, strategy={args.strategy}, world size 2 on one node, {args.steps} steps, median tokens/s "
          f"after step {args.warmup}, {args.rounds} rounds, {os.cpu_count()} CPUs")
    print(f"{'runtime':20} {'tokens/s':>10} {'vs torchrun':>12} {'to 1st step s':>14}")
    for name, rows in results.items():
        tok = statistics.mean(x["tok_s"] for x in rows)
        first = statistics.mean(x["first_step_s"] for x in rows)
        print(f"{name:20} {tok:10.0f} {tok / base:11.2f}x {first:14.1f}")


if __name__ == "__main__":
    main()
