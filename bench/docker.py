"""The same job under local torchrun and under `launcher=docker` on this host: throughput once started and the
time from `python -m trainer` to the first step.

Both are world size 2 on the `debug` model: local torchrun with 2 processes, Docker with 2 nodes of 1
process each (containers of `--image`, built by .ci/docker-image). Each run logs every step; tokens/s is the
median over the steps after `--warmup` of the per-step figure the worker logs (robust to a busy, shared
machine); the time to the first step is from starting `python -m trainer` until its first metrics line is
on disk (process starts, containers, rendezvous, model build and the first step). The runs alternate,
local then Docker, `--rounds` times, on one warm corpus cache.

Where that time goes, phase by phase, each ending when the last node reached its point (the first step waits for
all of them): `launch` until the first node starts (Docker: the engine's `create` event of the first container,
that is `docker run` issued; local: its first agent's process), `containers` until the last container started
(the engine's `start` events), `agent imports` until every node agent had imported torchrun, `agent rendezvous`
until every rank's process started, `rank imports` until every rank had imported the trainer, `process group`
until rank 0's group formed (the ranks' `trainjob.startup` line in their logs), `model, data, 1st step` until the
first metrics line.

    python bench/docker.py [--image trainjob:test] [--steps 30] [--warmup 5] [--rounds 2] [override ...]
"""
from __future__ import annotations

import argparse
import glob
import itertools
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
from trainjob.startup import POINTS  # noqa: E402

PHASES = ("launch", "containers", "agent imports", "agent rendezvous", "rank imports", "process group",
          "model, data, 1st step")

MODES = {
    "local torchrun": ["+runtime=torch-distributed", "runtime.nproc_per_node=2"],
    "docker": ["launcher=docker", "+runtime=torch-distributed", "runtime.nnodes=2"],
}


def run(mode: str, args, cache: str, run_dir: str) -> dict:
    overrides = [*MODES[mode], *([f"launcher.image={args.image}"] if mode == "docker" else []),
                 f"train.max_steps={args.steps}", "train.log_every=1", "train.eval_every=100000",
                 "train.checkpoint_every=100000", "train.progress=false", f"hydra.run.dir={run_dir}", *args.overrides]
    metrics = RunDir.of(run_dir).metrics
    env = {**os.environ, "TRAINJOB_CACHE": cache, "PYTHONPATH": REPO}
    events = engine_events(run_dir) if mode == "docker" else None
    wall, start = time.time(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *overrides], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            first = time.perf_counter() - start
        time.sleep(0.05)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        container_times(events)
        raise SystemExit(f"{mode}: python -m trainer exited with code {proc.returncode}: {proc.stderr.read()[-2000:]}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > args.warmup]
    return {"tok_s": statistics.median(rates), "first_step_s": first, "total_s": total,
            "phases": phases(wall, first, starts(run_dir), container_times(events))}


def engine_events(run_dir: str) -> subprocess.Popen:
    """The Docker engine's create and start events of the run's containers, from now on, as JSON lines."""
    return subprocess.Popen(["docker", "events", "--filter", "type=container", "--filter", "event=create",
                             "--filter", "event=start", "--filter", f"label=trainjob.run_dir={run_dir}",
                             "--format", "{{json .}}"], stdout=subprocess.PIPE, text=True)


def container_times(events: subprocess.Popen | None) -> tuple[float, float] | None:
    """When the first container was created (`docker run` issued) and the last one started, in seconds since the
    epoch; None for a local run."""
    if events is None:
        return None
    time.sleep(0.5)  # the last events reach the reader
    events.terminate()
    seen = [json.loads(line) for line in events.communicate()[0].splitlines() if line.strip()]
    at = {a: [e["timeNano"] / 1e9 for e in seen if e.get("Action", e.get("status")) == a] for a in ("create", "start")}
    return min(at["create"]), max(at["start"])


def starts(run_dir: str) -> list[dict]:
    """Every rank's `trainjob.startup` marks, from its log."""
    found = []
    for path in glob.glob(os.path.join(RunDir.of(run_dir).logs, "rank-*.log")):
        with open(path) as f:
            found += [json.loads(line.split(" startup ", 1)[1]) for line in f if " startup {" in line]
    return found


def phases(wall: float, first: float, ranks: list[dict], containers: tuple[float, float] | None) -> list[float]:
    """The seconds of each of `PHASES`, from the marks (each the last node's; a mark that came before the one
    before it counts from that one)."""
    points = {p: max((r[p] for r in ranks if r[p] is not None), default=None) for p in POINTS}
    launch = containers[0] if containers else min(r["agent_start"] for r in ranks)
    marks = [wall, launch, containers[1] if containers else launch, points["agent_ready"], points["rank_start"],
             points["imports_done"], points["group_formed"], wall + first]
    for i in range(1, len(marks)):  # a point no rank told (an image without trainjob.startup): no time of its own
        marks[i] = max(marks[i] if marks[i] is not None else marks[i - 1], marks[i - 1])
    return [b - a for a, b in itertools.pairwise(marks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=os.environ.get("TRAINJOB_DOCKER_IMAGE", "trainjob:test"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="more trainer overrides, for both")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-docker-") as top:
        cache = os.path.join(top, "cache")
        for r in range(args.rounds):
            for mode in MODES:
                results[mode].append(run(mode, args, cache, os.path.join(top, f"{mode.split()[0]}-{r}")))
    local = statistics.mean(x["tok_s"] for x in results["local torchrun"])
    print(f"\ndebug model, world size 2, {args.steps} steps, median tokens/s after step {args.warmup}, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")
    print(f"{'':16} {'tokens/s':>10} {'vs local':>9} {'to 1st step s':>14} {'whole run s':>12}")
    for mode, rows in results.items():
        tok = statistics.mean(x["tok_s"] for x in rows)
        first = statistics.mean(x["first_step_s"] for x in rows)
        total = statistics.mean(x["total_s"] for x in rows)
        print(f"{mode:16} {tok:10.0f} {100 * (tok / local - 1):+8.1f}% {first:14.1f} {total:12.1f}")
    firsts = {mode: statistics.mean(x["first_step_s"] for x in rows) for mode, rows in results.items()}
    print(f"docker's first step / local torchrun's: {firsts['docker'] / firsts['local torchrun']:.2f}x")
    print(f"\nto the first step, s (mean of {args.rounds} rounds)")
    print(f"{'':24}" + "".join(f"{mode:>16}" for mode in results) + f"{'difference':>12}")
    for i, phase in enumerate(PHASES):
        each = [statistics.mean(x["phases"][i] for x in rows) for rows in results.values()]
        print(f"{phase:24}" + "".join(f"{v:16.2f}" for v in each) + f"{each[1] - each[0]:+12.2f}")
    for mode, rows in results.items():
        print(f"  {mode}: tokens/s by round " + ", ".join(f"{x['tok_s']:.0f}" for x in rows)
              + "; first step s " + ", ".join(f"{x['first_step_s']:.1f}" for x in rows))


if __name__ == "__main__":
    main()
