"""`runtime=torch-distributed`: torchrun starts each node's ranks (Kubeflow Trainer's `torch-distributed`
runtime, `mlPolicy.torch`). A trainer run's agent is `torchrun` here (`python -m
trainjob.runtimes.torch_distributed.torchrun`), whose exit code is its failed rank's own; a function job's is plain
torchrun. An elastic job's rendezvous store, and that of nodes started one by one, is hosted apart from the nodes by
`rendezvous` here (`store_command`). The ranks read torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT as they are. The agents import torch; nothing imports them: they run as `python -m`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from trainjob.options import require
from trainjob.runtimes.base import Nodes, Offers, Runtime, check_counts

# The node agents beside this module, run as `python -m` (they import torch).
AGENT = "trainjob.runtimes.torch_distributed.torchrun"
STORE = "trainjob.runtimes.torch_distributed.rendezvous"

# Sharing torchrun's rendezvous store with the workers (the default) lets restarted workers read the failed
# attempt's addresses, so a restart after a dead rank fails to connect (pytorch/pytorch#135712); a fresh store
# per attempt avoids it.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

# An elastic job's rendezvous, and a fixed-size one's whose nodes start on their own (the local launcher): its
# store is hosted outside the nodes (`rendezvous` here), so that losing any node leaves it; a node whose
# heartbeats stop for keep_alive_interval x keep_alive_max_attempt seconds is gone. reform_last_call_timeout is
# read by this runtime's agent (`torchrun` here), not by torch.
ELASTIC_RDZV_CONF = ("is_host=false,keep_alive_interval={keep_alive_interval},"
                     "keep_alive_max_attempt={keep_alive_max_attempt},last_call_timeout={last_call_timeout},"
                     "reform_last_call_timeout={reform_last_call_timeout}")


@dataclass
class TorchDistributedConfig:
    # Each must be > 0 (`trainer.config.validate` checks it before `check()`).
    POSITIVE: ClassVar[tuple[str, ...]] = ("last_call_timeout", "reform_last_call_timeout", "keep_alive_interval",
                                           "keep_alive_max_attempt", "rdzv_timeout", "monitor_interval")
    name: str = "torch-distributed"  # the runtime chosen (torch-distributed: torchrun starts the ranks)
    # null: the GPU count on this machine, or 2 without GPUs.
    nproc_per_node: int | None = None
    # N nodes, or MIN:MAX for an elastic job (torchrun's elastic rendezvous: it goes on when nodes are lost, down
    # to MIN, and takes nodes that join, up to MAX).
    nnodes: Any = 1
    # This node's rank in a fixed-size run started once per node (torchrun's --node-rank); null: the first free
    # node slot of the run directory. A per-node setting: it is not saved in config.yaml.
    node_rank: int | None = None
    max_restarts: int = 0
    rdzv_backend: str = "c10d"
    # host:port of node 0; null on one node lets torchrun pick a free local port (--standalone).
    rdzv_endpoint: str | None = None
    rdzv_id: str = "trainjob"
    # Seconds between the agent's looks at its ranks (torchrun's --monitor-interval, its default).
    monitor_interval: float = 0.1
    # Elastic jobs: seconds the first rendezvous waits for more nodes once MIN have joined.
    last_call_timeout: int = 5
    # Elastic trainer runs (this runtime's agent reads it; a function job's plain torchrun does not): the same
    # wait once the nodes have formed, for a re-formation after a node was lost or joined. The nodes still
    # running reach it within torch's 1 s look at the store; one that misses it waits and the job re-forms again
    # (another start of its ranks). A node that has not formed yet (one joining) waits last_call_timeout.
    reform_last_call_timeout: int = 1
    # Elastic jobs: seconds between a node's heartbeats (torchrun's keep_alive_interval).
    keep_alive_interval: int = 1
    # Elastic jobs: intervals without a heartbeat that make a node lost (at least 3). Times keep_alive_interval,
    # it is how long the nodes left wait for a dead node before re-forming, and it trades that against false
    # alarms: a live node whose heartbeat runs that late (its agent stalled on an overloaded machine, its network
    # cut, or its clock behind the others': each node compares a heartbeat's time with its own clock) is taken
    # for lost. Raise it where that happens, at an interval more per recovery.
    keep_alive_max_attempt: int = 3
    # Seconds a node waits at the rendezvous for the others (torchrun's join_timeout) before it ends, saying
    # how many nodes joined and which never did.
    rdzv_timeout: int = 600


class TorchDistributed(Runtime):
    name = "torch-distributed"
    schema = TorchDistributedConfig
    runtime_ref = "torch-distributed"
    framework = "torch"
    kubeflow_image = "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime"
    elastic = True
    restarts = True
    function_jobs = True

    def check(self, options: TorchDistributedConfig) -> None:
        most = check_counts(options)
        if options.node_rank is not None:
            require(":" not in str(options.nnodes), "runtime.node_rank", options.node_rank,
                    f"runtime.nnodes={options.nnodes} is an elastic range, whose rendezvous assigns each node its "
                    "rank: leave runtime.node_rank unset")
            require(0 <= options.node_rank < most, "runtime.node_rank", options.node_rank,
                    f"must be in [0, runtime.nnodes={options.nnodes})")
        require(options.max_restarts >= 0, "runtime.max_restarts", options.max_restarts, "must be >= 0")
        require(options.keep_alive_max_attempt >= 3, "runtime.keep_alive_max_attempt", options.keep_alive_max_attempt,
                "must be >= 3: a live node's heartbeat comes every runtime.keep_alive_interval plus the store's "
                "round trip, and a window of fewer intervals takes a node whose heartbeat runs late for lost")

    def check_job(self, options: TorchDistributedConfig, counts: range, offers: Offers) -> None:
        # Remote launchers know node 0's address (Kubeflow injects it; Docker names the container).
        require(counts[-1] == 1 or bool(options.rdzv_endpoint) or not offers.nodes_started_here,
                "runtime.rdzv_endpoint", options.rdzv_endpoint, "must be host:port of node 0 when runtime.nnodes > 1 "
                "(an elastic range's: where its rendezvous store serves)")

    def node_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        # A trainer run's agent passes its failed rank's exit code on (2 refused, 143 preempted), and ends a
        # rendezvous that timed out with RDZV_TIMEOUT_EXIT (`torchrun` here); a function job's is torchrun's.
        agent = ["-m", AGENT] if nodes.trainer_run else ["-m", "torch.distributed.run"]
        return [nodes.python, *agent, *torchrun_args(options, nodes), *nodes.command]

    def kubeflow_command(self, options: Mapping[str, Any], nodes: Nodes) -> list[str]:
        # Kubeflow's torch plugin sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and the master's address, which
        # torchrun reads. A trainer run's agent passes its rank's exit code on, so that a refused config (2) and a
        # preemption (143) reach the pod's status; a function job's image need not hold trainjob: plain torchrun.
        # Restarts are the JobSet's (the runtime's failure policy): torchrun in a pod restarts nothing.
        agent = [nodes.python, "-m", AGENT] if nodes.trainer_run else ["torchrun"]
        return [*agent, "--max-restarts=0", *nodes.command]

    def agent_env(self, options: Mapping[str, Any]) -> dict[str, str]:
        return dict(AGENT_ENV)

    def store_command(self, python: str, endpoint: str, run_dir: str | None = None) -> list[str] | None:
        return [python, "-m", STORE, endpoint, *(["--run-dir", run_dir] if run_dir else [])]

    def ml_policy(self, options: Mapping[str, Any], nnodes: int, nproc_per_node: int) -> dict[str, Any]:
        return {"numNodes": nnodes, "torch": {"numProcPerNode": nproc_per_node}}


def torchrun_args(options: Mapping[str, Any], nodes: Nodes) -> list[str]:
    """torchrun's options. One node without an endpoint uses --standalone; else a c10d rendezvous at the
    endpoint (default: runtime.rdzv_endpoint), which every node joins; an elastic job gives the node range and
    a store that lives apart from its nodes, as does one whose nodes start one by one; a node waits
    `rdzv_timeout` seconds at the rendezvous for the others."""
    t = options
    args = [
        f"--nproc-per-node={nodes.nproc_per_node}",
        f"--nnodes={nodes.min_nodes}:{nodes.nnodes}" if nodes.min_nodes is not None else f"--nnodes={nodes.nnodes}",
        f"--max-restarts={t['max_restarts']}",
        f"--monitor-interval={t['monitor_interval']}",
    ]
    endpoint = nodes.endpoint or t["rdzv_endpoint"]
    if nodes.nnodes == 1 and not endpoint:
        return [*args, "--standalone"]
    args += [f"--rdzv-backend={t['rdzv_backend']}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={t['rdzv_id']}"]
    conf = ELASTIC_RDZV_CONF.format(**t) + "," if nodes.store_apart else ""
    return [*args, f"--rdzv-conf={conf}join_timeout={t['rdzv_timeout']}"]


RUNTIME = TorchDistributed()
