"""`python -m launchers list|get|metrics|logs|wait|delete|train|runtimes ...`: the Client's verbs from a terminal.

    python -m launchers list                                    jobs on this machine (launcher local)
    python -m launchers --launcher kubernetes --namespace team-a get tj-run-1234abcd
    python -m launchers metrics tj-run-1234abcd                 what it has logged, a JSON line a step
    python -m launchers logs tj-run-1234abcd --rank 0 --follow
    python -m launchers wait tj-run-1234abcd --status Complete --timeout 3600
    python -m launchers delete tj-run-1234abcd
    python -m launchers train --runtime jax-distributed --num-nodes 2 fit.py --func fit --args '{"lr": 0.1}'
    python -m launchers runtimes                                the runtimes: framework, image, device
    python -m launchers runtimes xgboost-distributed --packages what its environment holds

Exit codes: 0 done; 1 the launcher said no (no such job, an API error) or `wait` saw the job end
otherwise or time out; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from launchers import JobInfo, JobState, LauncherError, OptionError
from launchers.client import Client
from trainjob.cli import OneLineParser

COLUMNS = ("name", "state", "step", "loss", "eval_loss", "start_time", "end_time")


def _plain(info: JobInfo) -> dict:
    out = dataclasses.asdict(info)
    out["state"] = info.state.value
    out["steps"] = [{**step, "status": step["status"].value} for step in out["steps"]]
    for key in ("start_time", "end_time"):
        out[key] = out[key].isoformat() if out[key] else None
    return out


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def event_line(event: dict) -> str:
    """'reformation: <time>: world size 2 -> 1, resumed from step 14', 'preemption: <time>: at step 7, ...'."""
    kind, when = event.get("event"), event.get("time", "-")
    if kind in ("resume", "reformation"):
        return (f"{kind}: {when}: world size {event.get('world_size_before')} -> {event.get('world_size_after')}, "
                f"resumed from step {event.get('resumed_from_step')}")
    if kind == "preemption":
        return f"preemption: {when}: at step {event.get('at_step')}, checkpoint {event.get('checkpoint')}"
    return f"{kind}: {when}: " + ", ".join(f"{k} {v}" for k, v in event.items() if k not in ("event", "time"))


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m launchers",
        description="Follow and manage trainjob jobs on a "
        "launcher (start them with python -m trainer or launchers.Client).",
    )
    p.add_argument("--launcher", "-l", choices=("local", "docker", "kubernetes"), default="local")
    k8s = p.add_argument_group("kubernetes options")
    k8s.add_argument("--namespace")
    k8s.add_argument("--kubeconfig")
    k8s.add_argument("--context")
    k8s.add_argument("--local-run-root", help="where the pods' run directories are mounted here (for metrics)")
    verbs = p.add_subparsers(dest="verb", required=True,
                             metavar="{list,get,metrics,logs,wait,delete,train,runtimes}")
    ls = verbs.add_parser("list", help="the jobs on the launcher")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    get = verbs.add_parser("get", help="a job's state, step, losses and times")
    get.add_argument("name")
    get.add_argument("--json", action="store_true")
    metrics = verbs.add_parser("metrics", help="what a job has logged: one JSON object a logged step")
    metrics.add_argument("name")
    logs = verbs.add_parser("logs", help="a rank's log, or a step's")
    logs.add_argument("name")
    logs.add_argument("--rank", type=int, default=0)
    logs.add_argument("--step", help="a step of `get` (node-<i>; an MPI job's node-0 holds every rank's output)")
    logs.add_argument("--follow", "-f", action="store_true", help="until the job ends")
    wait = verbs.add_parser("wait", help="until the job reaches a state")
    wait.add_argument("name")
    wait.add_argument(
        "--status",
        action="append",
        choices=[s.value for s in JobState],
        help="the state to wait for (repeatable; default Complete)",
    )
    wait.add_argument("--timeout", type=float, default=600.0)
    wait.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    delete = verbs.add_parser("delete", help="stop the job and forget it (its run directory stays)")
    delete.add_argument("name")
    train = verbs.add_parser("train", help="run a function of a script on a runtime (Client.train(func=...))")
    train.add_argument("script", help="the Python file defining the function (imported here, so guard its own "
                       "top-level work with if __name__ == '__main__')")
    train.add_argument("--func", default="main", help="the function to run (default main)")
    train.add_argument("--args", default=None, help="its keyword arguments, as a JSON object")
    train.add_argument("--runtime", default="torch-distributed")
    train.add_argument("--num-nodes", type=int, default=1)
    train.add_argument("--nproc-per-node", type=int, default=1)
    train.add_argument("--packages", nargs="+", default=None, metavar="REQ", help="pip requirements to install first")
    train.add_argument("--run-dir", default=None)
    train.add_argument("--follow", "-f", action="store_true", help="print rank 0's log until the job ends; exit 1 "
                       "if it fails")
    rts = verbs.add_parser("runtimes", help="the runtimes, or one runtime's details")
    rts.add_argument("name", nargs="?")
    rts.add_argument("--packages", action="store_true", help="what the runtime's environment holds (pip list)")
    return p


def load_function(script: str, name: str):
    """Function `name` of the Python file `script` (imported as a module of its own)."""
    import importlib.util
    import os

    if not os.path.isfile(script):
        raise ValueError(f"{script}: no such file")
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(script))[0], script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    func = getattr(module, name, None)
    if func is None:
        raise ValueError(f"--func {name}: {script} defines no {name}")
    return func


def train(client: Client, args: argparse.Namespace) -> int:
    try:
        func_args = json.loads(args.args) if args.args is not None else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--args {args.args}: not JSON ({e})") from None
    if func_args is not None and not isinstance(func_args, dict):
        raise ValueError(f"--args {args.args}: must be a JSON object")
    name = client.train(func=load_function(args.script, args.func), func_args=func_args, runtime=args.runtime,
                        num_nodes=args.num_nodes, nproc_per_node=args.nproc_per_node,
                        packages_to_install=args.packages, run_dir=args.run_dir)
    print(name, flush=True)
    if not args.follow:
        return 0
    for line in client.get_job_logs(name, follow=True):
        print(line, flush=True)
    state = client.wait_for_job_status(name, status={s.value for s in JobState if s.finished}).state
    print(f"{name} {state.value}")
    return 0 if state == JobState.COMPLETE else 1


def show_runtimes(client: Client, args: argparse.Namespace) -> int:
    if args.name is None:
        if args.packages:
            raise ValueError("--packages shows one runtime's environment: give its NAME")
        rows = [("name", "framework", "image", "device", "count", "runs")] + [
            (r.name, r.trainer.framework, r.trainer.image, r.trainer.device, r.trainer.device_count,
             "functions" if r.function_only else "functions, trainer runs") for r in client.list_runtimes()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        return 0
    r = client.get_runtime(args.name)
    print(f"name: {r.name}\nkind: {r.kind}\nframework: {r.trainer.framework}\nimage: {r.trainer.image}\n"
          f"num_nodes: {r.trainer.num_nodes}\ndevice: {r.trainer.device}\ndevice_count: {r.trainer.device_count}\n"
          f"function_only: {str(r.function_only).lower()}")
    if args.packages:
        print(client.get_runtime_packages(args.name), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    keys = ("namespace", "kubeconfig", "context", "local_run_root")
    options = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if options and args.launcher != "kubernetes":
        flag = next(iter(options)).replace("_", "-")
        p.error(f"--{flag} is an option of --launcher kubernetes (the launcher is {args.launcher})")
    if getattr(args, "rank", 0) < 0:
        p.error(f"--rank {args.rank}: must be >= 0")
    if args.verb == "wait" and (args.timeout <= 0 or args.interval <= 0):
        p.error(f"--timeout {args.timeout:g} and --interval {args.interval:g} must be > 0")
    try:
        client = Client(args.launcher, **options)
        if args.verb == "list":
            jobs = [_plain(j) for j in client.list_jobs()]
            if args.json:
                for job in jobs:
                    print(json.dumps(job))
            else:
                rows = [COLUMNS] + [tuple(_cell(j[c]) for c in COLUMNS) for j in jobs]
                widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
                for row in rows:
                    print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        elif args.verb == "get":
            job = _plain(client.get_job(args.name))
            if args.json:
                print(json.dumps(job))
            else:
                print("\n".join(f"{k}: {_cell(v)}" for k, v in job.items() if k not in ("events", "steps")))
                for step in job["steps"]:  # Kubeflow's node-<i>: `logs --step`
                    print(f"step {step['name']}: {step['status']}" + (f" ({step['pod_name']})" if step["pod_name"]
                                                                       else ""))
                for event in job["events"]:  # resumes, re-formations, preemptions, oldest first
                    print(event_line(event))
        elif args.verb == "metrics":
            for record in client.get_job_metrics(args.name):
                print(json.dumps(record))
        elif args.verb == "logs":
            for line in client.get_job_logs(args.name, rank=args.rank, follow=args.follow, step=args.step):
                print(line, flush=True)
        elif args.verb == "wait":
            info = client.wait_for_job_status(
                args.name, status=args.status or ["Complete"], timeout=args.timeout, polling_interval=args.interval
            )
            print(f"{info.name} {info.state.value}")
        elif args.verb == "delete":
            client.delete_job(args.name)
            print(f"deleted {args.name}")
        elif args.verb == "train":
            return train(client, args)
        elif args.verb == "runtimes":
            return show_runtimes(client, args)
    except (OptionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (LauncherError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
