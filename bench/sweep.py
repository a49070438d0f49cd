"""The same 16-trial search over the learning rate and the warmup, three ways: a grid, Optuna's TPE, and TPE
with the median pruner (`hydra/sweeper=optuna`, trainer/sweep/). Each way is one `python -m trainer -m` sweep
of the default model (`--steps` steps, an eval every `--eval-every`); the table gives each way's best final
eval loss, the steps trained in all (a pruned trial's up to where it was stopped), the trials pruned, and
the wall time. Target: the pruned search's best within 1% of the grid's, for at most half its steps.

    python bench/sweep.py [--steps 40] [--eval-every 5] [--n-jobs 2] [--seed 0] [override ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
from trainjob.run_files import read_events, read_metrics  # noqa: E402

# 4 x 4 points: the grid's 16 trials, and the space TPE searches in its 16.
LRS = "choice(3e-4,1e-3,3e-3,1e-2)"
WARMUPS = "choice(0,5,10,20)"
WAYS = {
    "grid": ["hydra.sweeper.sampler=grid"],
    "tpe": ["hydra.sweeper.sampler=tpe"],
    "tpe + median pruner": ["hydra.sweeper.sampler=tpe", "hydra.sweeper.pruner=median"],
}


def run_way(extra: list[str], args: argparse.Namespace, sweep_dir: str) -> dict:
    """One sweep; its best eval loss, steps trained, trials pruned and wall seconds."""
    command = [
        sys.executable,
        "-m",
        "trainer",
        "-m",
        "hydra/sweeper=optuna",
        *extra,
        "hydra.sweeper.n_trials=16",
        f"hydra.sweeper.n_jobs={args.n_jobs}",
        f"hydra.sweeper.seed={args.seed}",
        f"optim.lr={LRS}",
        f"lr_schedule.warmup_steps={WARMUPS}",
        f"train.max_steps={args.steps}",
        f"train.eval_every={args.eval_every}",
        "train.log_every=5",
        "train.progress=false",
        f"train.checkpoint_every={args.steps * 10}",
        f"hydra.sweep.dir={sweep_dir}",
        *args.overrides,
    ]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(extra)}: the sweep failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with open(os.path.join(sweep_dir, "optimization_results.yaml")) as f:
        best = yaml.safe_load(f)["best_value"]
    runs = [os.path.join(sweep_dir, d) for d in os.listdir(sweep_dir) if d.isdigit()]
    steps = sum(max((r["step"] for r in read_metrics(run)), default=0) for run in runs)
    pruned = sum(any(e["event"] == "pruned" for e in read_events(run)) for run in runs)
    return {"best": best, "steps": steps, "pruned": pruned, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--n-jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"which to run, of: {','.join(WAYS)}")
    parser.add_argument("--grid-best", type=float, help="the grid's best eval loss of an earlier run: the grid not run")
    parser.add_argument("--grid-steps", type=int, default=None, help="with --grid-best: the grid's steps")
    parser.add_argument("overrides", nargs="*", help="more overrides for every trial (e.g. train.global_batch_size=8)")
    args = parser.parse_args()
    results, ways = {}, {w: e for w, e in WAYS.items() if w in args.ways.split(",")}
    if args.grid_best is not None:  # a grid trains every point to the end: its steps are 16 x --steps
        results["grid"] = {
            "best": args.grid_best,
            "steps": args.grid_steps or 16 * args.steps,
            "pruned": 0,
            "wall": float("nan"),
        }
        ways.pop("grid", None)
    with tempfile.TemporaryDirectory() as root:
        for i, (way, extra) in enumerate(ways.items()):
            results[way] = run_way(extra, args, os.path.join(root, str(i)))
            print(f"{way}: {results[way]}", file=sys.stderr, flush=True)
    grid = results["grid"]
    print(
        f"16 trials, optim.lr={LRS} x lr_schedule.warmup_steps={WARMUPS}, {args.steps} steps each, "
        f"{args.n_jobs} at once"
    )
    print(f"{'way':<22}{'best eval loss':>15}{'vs grid':>9}{'steps':>7}{'of grid':>9}{'pruned':>8}{'wall s':>8}")
    for way, r in results.items():
        print(
            f"{way:<22}{r['best']:>15.4f}{(r['best'] / grid['best'] - 1) * 100:>+8.2f}%{r['steps']:>7d}"
            f"{r['steps'] / grid['steps'] * 100:>8.0f}%{r['pruned']:>8d}{r['wall']:>8.0f}"
        )


if __name__ == "__main__":
    main()
