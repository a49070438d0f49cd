"""`deepspeed-distributed` for a user's function (Kubeflow Trainer's DeepSpeed runtime: its MPI plugin,
`mlPolicy.mpi`): every rank under `mpirun`; the function calls `deepspeed.init_distributed()`, which finds its
rank, world size and local rank from MPI (mpi4py) and sets torch.distributed's variables. A function-only
runtime (`trainjob.runtimes.function`); a trainer run on MPI is `runtime=mpi`."""

from __future__ import annotations

from dataclasses import dataclass

from trainjob.runtimes.function import MPIFunction


@dataclass
class DeepSpeedDistributedConfig:
    name: str = "deepspeed-distributed"  # a function-only runtime (Client.train(func=..., runtime=...))


class DeepSpeedDistributed(MPIFunction):
    name = "deepspeed-distributed"
    schema = DeepSpeedDistributedConfig
    runtime_ref = "deepspeed-distributed"
    framework = "deepspeed"
    kubeflow_image = "ghcr.io/kubeflow/trainer/deepspeed-runtime"
    extra = "deepspeed"
    imports = ("deepspeed", "mpi4py")


RUNTIME = DeepSpeedDistributed()
