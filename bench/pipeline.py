"""Pipeline parallelism against one process, step by step: the largest relative difference of the training loss
(and of the gradient norm) over `--steps` steps, and of the final eval loss, for each schedule on 2 processes and
pp combined with fsdp2 and with tp on 4; each row passes when every difference is within `--rtol` (1e-6).

    python bench/pipeline.py [--steps 20] [--rtol 1e-6] [override ...]

The model is `model=debug` (four blocks: two stages of two, or four of one for interleaved_1f1b) on a short
sequence and batch, so that the 4-process rows fit a 2-core machine; overrides change any of it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
from trainjob.run_files import read_metrics, read_summary  # noqa: E402

TWO = ["+runtime=torch-distributed", "runtime.nproc_per_node=2"]
FOUR = ["+runtime=torch-distributed", "runtime.nproc_per_node=4"]
VARIANTS = {
    "pp=2 gpipe": [*TWO, "strategy=pp", "strategy.pp_schedule=gpipe"],
    "pp=2 1f1b": [*TWO, "strategy=pp", "strategy.pp_schedule=1f1b", "strategy.pp_microbatches=4"],
    "pp=2 interleaved_1f1b": [*TWO, "strategy=pp", "strategy.pp_schedule=interleaved_1f1b"],
    "fsdp2_pp (pp=2 x dp_shard=2)": [*FOUR, "strategy=fsdp2_pp"],
    "pp=2 x tp=2": [*FOUR, "strategy=tp", "strategy.pp=2"],
}


def run(args: list[str], run_dir: str) -> tuple[list[dict], dict, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainer", *args, f"hydra.run.dir={run_dir}"], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{args}: {proc.stderr.strip().splitlines()[-1] if proc.stderr else 'failed'}")
    metrics = [r for r in read_metrics(run_dir) if "loss" in r]
    return metrics, read_summary(run_dir), time.perf_counter() - start


def worst(ours: list[dict], ref: list[dict], key: str) -> float:
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(ours, ref, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rtol", type=float, default=1e-6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    common = ["model=debug", "data.seq_len=64", "train.global_batch_size=8", "lr_schedule.warmup_steps=4",
              f"train.max_steps={args.steps}", f"train.eval_every={args.steps}", "train.eval_batches=2",
              f"train.checkpoint_every={args.steps * 10}", "train.log_every=1", "train.progress=false",
              "train.resume=never", *args.overrides]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref, ref_summary, ref_s = run(common, os.path.join(tmp, "single"))
        print(f"measured one process ({ref_s:.0f} s)", file=sys.stderr, flush=True)
        for i, (name, extra) in enumerate(VARIANTS.items()):
            metrics, summary, took = run([*common, *extra], os.path.join(tmp, str(i)))
            ref_eval = ref_summary["final_eval_loss"]
            eval_diff = abs(summary["final_eval_loss"] - ref_eval) / ref_eval
            rows.append((name, summary["world_size"], len(metrics), worst(metrics, ref, "loss"),
                         worst(metrics, ref, "grad_norm"), eval_diff, took))
            print(f"measured {name} ({took:.0f} s)", file=sys.stderr, flush=True)
    print(f"\nagainst one process, {args.steps} steps of model=debug (loss at step 1: {ref[0]['loss']:.4f}, "
          f"at step {args.steps}: {ref[-1]['loss']:.4f})")
    print(f"{'variant':<30}{'ranks':>6}{'steps':>6}{'max rel loss':>14}{'max rel gnorm':>15}{'rel eval':>11}"
          f"{'wall s':>8}  within {args.rtol:g}")
    for name, world, steps, loss, gnorm, eval_diff, took in rows:
        ok = max(loss, eval_diff) <= args.rtol and steps == args.steps
        print(f"{name:<30}{world:>6}{steps:>6}{loss:>14.2e}{gnorm:>15.2e}{eval_diff:>11.2e}{took:>8.0f}  "
              f"{'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
