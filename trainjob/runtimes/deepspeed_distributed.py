"""`runtime=deepspeed-distributed`: Kubeflow Trainer's DeepSpeed runtime, which is its MPI plugin
(`mlPolicy.mpi`) under the `deepspeed` framework label: OpenMPI's `mpirun` starts every rank from one launcher,
as under `runtime=mpi` (the same node command, rank environment and Kubeflow command), and the ranks train
with the DeepSpeed engine (`strategy=deepspeed`, the one strategy it runs and that runs only here), which saves
its checkpoints in the step and into files of its own (no `train.checkpoint_async`, no
`train.checkpoint_threads`).

It needs mpirun (Debian's openmpi-bin) and the `deepspeed` package (the `deepspeed` extra of trainjob) where it
starts: without either, the run is refused before anything starts."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

from trainjob.options import require
from trainjob.runtimes.base import Offers, RunFacts
from trainjob.runtimes.mpi import MPI, MPIConfig

# The pip extra that installs the DeepSpeed engine (pyproject.toml), with its compiled ops left out: none is
# used (the optimizer is torch's), so no compiler is needed.
INSTALL = "DS_BUILD_OPS=0 pip install -e '.[deepspeed]'"


@dataclass
class DeepSpeedDistributedConfig(MPIConfig):
    name: str = "deepspeed-distributed"  # the runtime chosen (mpirun starts the ranks; DeepSpeed trains)

    POSITIVE: ClassVar[tuple[str, ...]] = ()


class DeepSpeedDistributed(MPI):
    name = "deepspeed-distributed"
    schema = DeepSpeedDistributedConfig
    runtime_ref = "deepspeed-distributed"
    framework = "deepspeed"
    strategies = ("deepspeed",)
    owns = ("deepspeed",)
    # mpi4py: a function's deepspeed.init_distributed() reads its rank from MPI with it.
    imports = ("deepspeed", "mpi4py")
    extra = "deepspeed"

    def check_run(self, options: DeepSpeedDistributedConfig, run: RunFacts, offers: Offers) -> None:
        require(run.data_parallel != "deepspeed" or not run.checkpoint_async, "train.checkpoint_async", True,
                "strategy=deepspeed saves with DeepSpeed's own save_checkpoint, which writes in the step: give false")
        require(run.data_parallel != "deepspeed" or run.checkpoint_threads == 1, "train.checkpoint_threads",
                run.checkpoint_threads, "strategy=deepspeed saves with DeepSpeed's own save_checkpoint, which "
                "writes its own files: give 1")
        super().check_run(options, run, offers)

    def missing(self) -> str | None:
        lacking = super().missing()
        absent = [m for m in self.imports if importlib.util.find_spec(m) is None]
        if lacking is None and absent:
            return (f"runtime={self.name} needs {' and '.join(absent)}, not installed here: install trainjob's "
                    f"deepspeed extra ({INSTALL})")
        return lacking


RUNTIME = DeepSpeedDistributed()
