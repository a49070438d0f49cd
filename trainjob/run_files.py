"""A run directory's files: the one place that names them, and their readers and writers (the ranks write
them, the driver, the launchers, the trainer's report command and the benches read them).

config.yaml          the resolved config every rank ran (an earlier, different one: config.<n>.yaml)
metrics.jsonl        one JSON object per logged step (rank 0)
events.jsonl         one JSON object per event of the run: a resume, a re-formation, a preemption (rank 0)
summary.json         the final metrics (rank 0)
loss.png             train and eval loss against step, drawn from metrics.jsonl when the run ends
tb/, mlruns/         TensorBoard's events, MLflow's file store (tracker.report_to; W&B writes wandb/ itself)
tracking.json        the MLflow and W&B run ids a resumed run goes on with
train_func.py        a function job's script (the Client's `train(func=...)`)
venv/                a local function job's own environment, holding its packages_to_install
manifests.yaml       what a Kubernetes run submitted
checkpoints/step-N/  DCP checkpoints
logs/rank-R.log      each rank's log
logs/rank-R.error    what rank R refused or the report of its user code that failed (the driver prints one rank's, once)
logs/cache-node-I.log, logs/rendezvous.log
                     the log of cache node I, of the rendezvous store (local runs that start them)
.lock                held (flock) by the driver that trains here, and by the job it launched; shared
                     by the nodes of a multi-node run, each of which also holds its own slot:
.node-I.lock         held by the driver of node I of a multi-node run started here once per node

Readers take what a kill or a full disk left: a line cut short is skipped, a summary that is not whole is none.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import math
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from trainjob.files import write_whole

log = logging.getLogger(__name__)


class RunDir:
    """The paths of the files of the run whose directory is `root`; `RunDir.of(root)` builds them once per
    process."""

    @classmethod
    def of(cls, root: str) -> RunDir:
        return _paths(root)

    def __init__(self, root: str):
        self.root = root
        self.config = os.path.join(root, "config.yaml")
        self.metrics = os.path.join(root, "metrics.jsonl")
        self.events = os.path.join(root, "events.jsonl")
        self.summary = os.path.join(root, "summary.json")
        self.loss_png = os.path.join(root, "loss.png")
        self.tensorboard = os.path.join(root, "tb")
        self.mlruns = os.path.join(root, "mlruns")
        self.tracking = os.path.join(root, "tracking.json")
        self.func_script = os.path.join(root, "train_func.py")
        self.venv = os.path.join(root, "venv")
        self.manifests = os.path.join(root, "manifests.yaml")
        self.checkpoints = os.path.join(root, "checkpoints")
        self.logs = os.path.join(root, "logs")
        self.lock = os.path.join(root, ".lock")

    def earlier_config(self, n: int) -> str:
        """Where the n-th earlier config.yaml of the directory is kept when a different one is saved."""
        return os.path.join(self.root, f"config.{n}.yaml")

    def rank_log(self, rank: int) -> str:
        return os.path.join(self.logs, f"rank-{rank}.log")

    def error_report(self, rank: int) -> str:
        """Where rank `rank` leaves what it refused, or the report of user code that failed."""
        return os.path.join(self.logs, f"rank-{rank}.error")

    def cache_node_log(self, node: int) -> str:
        return os.path.join(self.logs, f"cache-node-{node}.log")

    @property
    def rendezvous_log(self) -> str:
        return os.path.join(self.logs, "rendezvous.log")

    def error_reports(self) -> dict[int, str]:
        """Rank -> the path of the report it left (`error_report`), for every rank that left one."""
        found = {}
        for path in glob.glob(os.path.join(glob.escape(self.logs), "rank-*.error")):
            rank = os.path.basename(path)[len("rank-"):-len(".error")]
            if rank.isdigit():
                found[int(rank)] = path
        return found

    def node_slot(self, node: int) -> str:
        """The lock file node `node` of a multi-node run started here once per node holds."""
        return os.path.join(self.root, f".node-{node}.lock")

    def node_slots(self) -> list[str]:
        """The node slots (`node_slot`) that exist."""
        return glob.glob(os.path.join(glob.escape(self.root), ".node-*.lock"))

    def is_run(self) -> bool:
        """Whether the directory holds a run: its config.yaml, and its metrics lines or its summary."""
        return os.path.isfile(self.config) and (os.path.isfile(self.metrics) or os.path.isfile(self.summary))


@functools.cache
def _paths(root: str) -> RunDir:
    return RunDir(root)


def json_lines(path: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of the lines of `path`; a line being written, or not an object, is skipped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    yield record
    except OSError:
        return


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The run's step records from metrics.jsonl, oldest first (events and lines of another kind left out)."""
    return [r for r in json_lines(RunDir.of(run_dir).metrics)
            if isinstance(r.get("step", 0), int) and "event" not in r]


def read_summary(run_dir: str) -> dict[str, Any] | None:
    """The run's summary.json; None when there is none, or none that reads as one (truncated by a full
    disk or a kill: the run did not get to write it whole)."""
    try:
        with open(RunDir.of(run_dir).summary, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def write_summary(run_dir: str, summary: dict[str, Any]) -> None:
    """Write summary.json whole; a loss that was never measured (NaN: no step run) is null, as strict JSON has
    no NaN."""
    write_whole(RunDir.of(run_dir).summary, json.dumps(
        {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in summary.items()}, indent=2))


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """The run's events, oldest first: each resume, re-formation (`world_size_before`, `world_size_after`,
    `resumed_from_step`) and preemption (`at_step`, `checkpoint`), with its `time`, from `events.jsonl`
    (and from `metrics.jsonl`, where a run of an earlier version wrote them)."""
    paths = RunDir.of(run_dir)
    older = [{k: v for k, v in r.items() if k != "step"} for r in json_lines(paths.metrics) if "event" in r]
    return older + [r for r in json_lines(paths.events) if "event" in r]


def write_event(run_dir: str, kind: str, **facts: Any) -> None:
    """Append an event of the run (`kind`: resume, reformation, preemption) to `events.jsonl`, with when it
    happened. Events have a file of their own so that `metrics.jsonl` holds one record per logged step; an
    event carries no `step` key (it names the step it is about: `resumed_from_step`, `at_step`)."""
    event = {"event": kind, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **facts}
    with open(RunDir.of(run_dir).events, "a") as f:
        f.write(json.dumps(event) + "\n")


def keep_metrics_until(run_dir: str, step: int) -> dict[str, Any] | None:
    """Drop the records of metrics.jsonl after `step`, where this run goes on from: what followed was never
    kept (a failed attempt, or a line abandoned by resuming from an earlier checkpoint). A line cut short (a
    kill, a full disk) is dropped too, and said so. An event line (written there before events had a file
    of their own) moves to `events.jsonl`. Returns the last step record kept."""
    paths = RunDir.of(run_dir)
    if not os.path.exists(paths.metrics):
        return None
    kept, events, last, after, broken = [], [], None, 0, 0
    with open(paths.metrics) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                broken += 1
                continue
            if isinstance(record, dict) and "event" in record:
                events.append(json.dumps({k: v for k, v in record.items() if k != "step"}) + "\n")
            elif not isinstance(record, dict) or not isinstance(record.get("step"), int):
                broken += 1
            elif record["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
                last = record
            else:
                after += 1
    if broken:
        log.warning("%s: dropped %d unreadable line(s) (cut short by a kill or a full disk?)", paths.metrics, broken)
    if after:
        log.info("%s: dropped %d record(s) after step %d, where this run goes on from", paths.metrics, after, step)
    if events:
        with open(paths.events, "a") as f:
            f.writelines(events)
    write_whole(paths.metrics, "".join(kept))
    return last


def read_progress(run_dir: str) -> dict[str, Any]:
    """Step, last loss and last eval loss of the run in `run_dir`, from the files its rank 0 writes:
    `metrics.jsonl` while it trains, `summary.json` once it is done; and the run's events (`read_events`:
    resumes, re-formations, preemptions)."""
    found: dict[str, Any] = {"step": None, "loss": None, "eval_loss": None}
    for record in read_metrics(run_dir):
        found["step"], found["loss"] = record.get("step", found["step"]), record.get("loss", found["loss"])
        if record.get("eval_loss") is not None:
            found["eval_loss"] = record["eval_loss"]
    events = read_events(run_dir)
    if events:
        found["events"] = events
    summary = read_summary(run_dir) if os.path.isdir(run_dir) else None
    if summary:
        found.update(
            step=summary.get("steps", found["step"]),
            loss=summary.get("final_train_loss", found["loss"]),
            eval_loss=summary.get("final_eval_loss", found["eval_loss"]),
        )
    return found
