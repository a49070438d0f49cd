"""Step time, throughput and peak memory per rank for each parallelism strategy.

Runs `python -m trainer` for the `debug` model under each strategy: in-process (world size 1) for
reference, then every preset in conf/strategy on `--nproc` torchrun processes (gloo on CPUs, nccl on
GPUs; NCCL needs one GPU per process). Step time is the median wall-clock gap between logged steps after
`--warmup`, so everything the loop does counts. Peak memory is each rank's allocated GPU memory, or its
maximum RSS on CPUs.

    python bench/strategies.py [--nproc 2] [--steps 20] [--warmup 5] [--only fsdp2,fsdp2_cp] [override ...]

Context parallelism's peak memory per rank against one process, on 8,192-token rows of `debug`:

    python bench/strategies.py --nproc 2 --steps 4 --warmup 1 --only fsdp2_cp data.seq_len=8192 \
        model.max_seq_len=8192 train.global_batch_size=1
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
from trainjob.run_files import read_metrics, read_summary  # noqa: E402

STRATEGIES = sorted(f.removesuffix(".yaml") for f in os.listdir(os.path.join(REPO, "conf", "strategy")))


def measure(name: str, args: list[str], run_dir: str, warmup: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "trainer", *args, f"hydra.run.dir={run_dir}"], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    elapsed = [m["elapsed_s"] for m in read_metrics(run_dir)]
    summary = read_summary(run_dir)
    step = statistics.median([b - a for a, b in itertools.pairwise(elapsed)][warmup:])
    return {"name": name, "world": summary["world_size"], "step_s": step,
            "tokens_per_s": summary["tokens"] / summary["steps"] / step,
            "peak_gb": summary["peak_memory_gb_per_rank"], "eval_loss": summary["final_eval_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", default=",".join(STRATEGIES),
                        help="the presets to measure, comma-separated (default: every one)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    common = [*args.overrides, f"train.max_steps={args.steps}", f"train.eval_every={args.steps}",
              f"train.checkpoint_every={args.steps * 10}", "train.log_every=1", "train.progress=false",
              "train.resume=never"]
    runs = [("single (in-process)", [])]
    runs += [(s, ["+runtime=torch-distributed", f"runtime.nproc_per_node={args.nproc}", f"strategy={s}"])
             for s in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(runs):
            rows.append(measure(name, [*common, *extra], os.path.join(tmp, str(i)), args.warmup))
            print(f"measured {name}", file=sys.stderr, flush=True)
    print(f"\n{'strategy':<22}{'ranks':>6}{'step ms':>10}{'tokens/s':>11}{'eval loss':>11}  peak memory per rank (GB)")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<22} failed: {r['error']}")
            continue
        peaks = " ".join(f"{p:.2f}" for p in r["peak_gb"])
        print(f"{r['name']:<22}{r['world']:>6}{r['step_s'] * 1e3:>10.1f}{r['tokens_per_s']:>11.0f}"
              f"{r['eval_loss']:>11.4f}  {peaks}")


if __name__ == "__main__":
    main()
