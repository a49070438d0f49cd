"""The runtimes, one module each (`runtime=<name>`; `conf/runtime/<name>.yaml` holds its values): how a job's
ranks start on its nodes and find each other (`base.Runtime`). Adding one is a module here holding its
`Runtime` subclass and schema, its name in `_MODULES`, and its yaml (docs/runtimes.md).

torch_distributed   torchrun (Kubeflow's torch-distributed)
mpi                 OpenMPI's mpirun (Kubeflow's MPI plugin)
deepspeed_distributed   mpirun, the ranks training with DeepSpeed (Kubeflow's deepspeed-distributed)
jax_distributed, xgboost_distributed, mlx_distributed
                    a user's function only (Client.train(func=...)): Kubeflow's JAX, XGBoost and MLX runtimes
                    (function.py: what they share)
"""

from __future__ import annotations

import importlib

from trainjob.options import OptionError
from trainjob.runtimes.base import Nodes, Offers, Runtime

_MODULES = {"torch-distributed": "torch_distributed", "mpi": "mpi", "jax-distributed": "jax_distributed",
            "xgboost-distributed": "xgboost_distributed", "mlx-distributed": "mlx_distributed",
            "deepspeed-distributed": "deepspeed_distributed"}
NAMES = tuple(_MODULES)


def get(name: str) -> Runtime:
    """The runtime called `name`; OptionError naming runtime.name where there is none."""
    if name not in _MODULES:
        raise OptionError("runtime.name", name, f"must be one of {', '.join(NAMES)}")
    return importlib.import_module(f"trainjob.runtimes.{_MODULES[name]}").RUNTIME


def schemas() -> dict[str, type]:
    """Each runtime's schema, by name."""
    return {name: get(name).schema for name in NAMES}


__all__ = ["NAMES", "Nodes", "Offers", "OptionError", "Runtime", "get", "schemas"]
