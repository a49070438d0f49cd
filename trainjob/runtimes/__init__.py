"""The runtimes, one unit each (`runtime=<name>`; `conf/runtime/<name>.yaml` holds its values): how a job's
ranks start on its nodes and find each other (`base.Runtime`). Each runtime is one module here, or one folder
where it has more than its unit: its node agents (run as `python -m`, imported by nothing: they load torch) and
what a launcher asks of it. Adding one is a module (or folder) here holding its `Runtime` subclass and schema, its
name in `_MODULES`, and its yaml (docs/runtimes.md). The launchers and the trainer reach a runtime through this
face alone (`get(name)`, the `Runtime` type), never a runtime's own module.

torch_distributed/  torchrun (Kubeflow's torch-distributed); `torchrun`, its agent passing a rank's exit code on;
                    `rendezvous`, an elastic run's store hosted apart from the nodes
mpi/                OpenMPI's mpirun (Kubeflow's MPI plugin); `hosts`, the layout of its SSH hosts
deepspeed_distributed   mpirun, the ranks training with DeepSpeed (Kubeflow's deepspeed-distributed)
jax_distributed, xgboost_distributed/, mlx_distributed
                    a user's function only (Client.train(func=...)): Kubeflow's JAX, XGBoost and MLX runtimes
                    (function/: what they share, and `procs`, the agent of one process per node here;
                    xgboost_distributed/`tracker`: an XGBoost job's workers joined in one line)
"""

from __future__ import annotations

import importlib

from trainjob.options import OptionError, require
from trainjob.runtimes.base import UNKNOWN, Nodes, Offers, RunFacts, Runtime, RuntimeInfo

_MODULES = {"torch-distributed": "torch_distributed", "mpi": "mpi", "jax-distributed": "jax_distributed",
            "xgboost-distributed": "xgboost_distributed", "mlx-distributed": "mlx_distributed",
            "deepspeed-distributed": "deepspeed_distributed"}
NAMES = tuple(_MODULES)


def get(name: str) -> Runtime:
    """The runtime called `name`; OptionError naming runtime.name where there is none."""
    if name not in _MODULES:
        raise OptionError("runtime.name", name, f"must be one of {', '.join(NAMES)}")
    return importlib.import_module(f"trainjob.runtimes.{_MODULES[name]}").RUNTIME


def check_strategy(name: str | None, strategy: str, data_parallel: str) -> None:
    """A strategy that one runtime owns runs under it alone (strategy=deepspeed and runtime=deepspeed-distributed:
    `Runtime.owns`, naming strategy.data_parallel values); `name`: the run's runtime (None: none)."""
    owners = [n for n in NAMES if data_parallel in get(n).owns]
    if owners:
        require(name in owners, "strategy", strategy, f"strategy.data_parallel={data_parallel} runs under "
                f"runtime={owners[0]} only (runtime is {name or 'null'}): add runtime={owners[0]}")


def schemas() -> dict[str, type]:
    """Each runtime's schema, by name."""
    return {name: get(name).schema for name in NAMES}


__all__ = ["NAMES", "UNKNOWN", "Nodes", "Offers", "OptionError", "RunFacts", "Runtime", "RuntimeInfo", "check_strategy",
           "get", "schemas"]
