"""`python -m launchers.kubernetes.cluster_runtimes [--image IMAGE] [--max-restarts N] [--kai-queue QUEUE]`: the
ClusterTrainingRuntimes a cluster admin applies once (`... | kubectl apply -f -`), so that users who may not create
TrainingRuntimes in their namespace run with `launcher.runtime_ref=<name>`, each job creating no runtime of its
own. One per gang scheduler (`none` serves kueue too: Kueue's settings are the TrainJob's), each with trainjob's
failure policies (`schedulers.add_failure_policies`) and its pod group or scheduler name, and each again with
Kubeflow's model and dataset initializers (`-initializers`: for runs whose model.path or data.path is a URL; their
TrainJobs name what to fetch). Named `trainjob-<runtime>[-<scheduler>][-initializers]`."""

from __future__ import annotations

import sys
from typing import Any

from launchers.kubernetes import initializers, schedulers
from launchers.kubernetes.manifests import to_yaml
from trainjob.cli import OneLineParser

GANGS = ("none", "volcano", "coscheduling", "kai")


def cluster_runtimes(image: str, max_restarts: int = 0, kai_queue: str = "default") -> list[dict[str, Any]]:
    """Every ClusterTrainingRuntime of trainjob's torch runtime: each scheduler's variant, without and with the
    initializers."""
    out = []
    for gang in GANGS:
        scheduler = {"name": gang, "queue": kai_queue if gang == "kai" else None}
        for fetches in (False, True):
            name = "trainjob-torch" + (f"-{gang}" if gang != "none" else "") + ("-initializers" if fetches else "")
            runtime = schedulers.derived_runtime(scheduler, schedulers.builtin_torch_runtime(image), name, "",
                                                 {"app.kubernetes.io/managed-by": "trainjob"}, max_restarts)
            if fetches:
                initializers.add_jobs(runtime["spec"], ("model", "dataset"))
            runtime["kind"] = "ClusterTrainingRuntime"
            del runtime["metadata"]["namespace"]
            out.append(runtime)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m launchers.kubernetes.cluster_runtimes",
                           description="Print the ClusterTrainingRuntimes an admin applies once for trainjob.")
    parser.add_argument("--image", default="trainjob:latest", help="the image the nodes run (launcher.image)")
    parser.add_argument("--max-restarts", type=int, default=0, help="the JobSet's failurePolicy.maxRestarts")
    parser.add_argument("--kai-queue", default="default", help="the KAI scheduler's queue of its variant's pods")
    args = parser.parse_args(argv)
    print(to_yaml(cluster_runtimes(args.image, args.max_restarts, args.kai_queue)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
