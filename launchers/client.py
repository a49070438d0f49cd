"""`Client`: Kubeflow TrainerClient's verbs over every launcher.

    client = Client("kubernetes", namespace="team-a")         # or Client("local"), Client("docker", image=...)
    name = client.train("model=1b", "+runtime=torch-distributed")   # python -m trainer, not waiting
    name = client.train(func=my_train, func_args={"lr": 3e-4}, num_nodes=2)
    name = client.train(func=fit, runtime="jax-distributed", num_nodes=2, packages_to_install=["optax"])
    client.list_runtimes(); client.get_runtime("xgboost-distributed"); client.get_runtime_packages("mpi")
    client.list_jobs(); client.get_job(name); client.get_job_metrics(name)   # one record a logged step
    for line in client.get_job_logs(name, rank=0, follow=True): print(line)
    client.get_job(name).steps; client.get_job_logs(name, step="node-0")   # Kubeflow's steps: node-<i>
    client.wait_for_job_status(name, status="Complete", timeout=3600)
    client.delete_job(name)

`train(*overrides)` runs `python -m trainer` in a subprocess (the same Hydra composition, validation and
run directory as the command line; this package never imports the trainer). `train(func=...)` ships the
function's source with the job as Kubeflow's CustomTrainer does, and runs it on every node under the runtime
it names (torchrun by default; `trainjob.runtimes`: JAX, XGBoost, MLX, DeepSpeed, MPI).

Each verb is one line: the launcher's backend answers it (`launchers.backend.Backend` declares every verb, as
Kubeflow SDK's backends do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from launchers.base import JobInfo
from launchers.options import client_backend
from trainjob.runtimes import RuntimeInfo


class Client:
    """Jobs on one launcher (`local`, `docker` or `kubernetes`) with that launcher's options (the keys of
    its `launcher.*` config, such as `namespace=` or `image=`)."""

    def __init__(self, launcher: str = "local", **options: Any):
        self.launcher, self.options = launcher, dict(options)
        self._backend = client_backend(launcher, options)

    def train(
        self,
        *overrides: str,
        func: Callable | None = None,
        func_args: dict[str, Any] | None = None,
        runtime: str = "torch-distributed",
        num_nodes: int = 1,
        nproc_per_node: int = 1,
        resources_per_node: dict[str, Any] | None = None,
        packages_to_install: list[str] | None = None,
        run_dir: str | None = None,
    ) -> str:
        """Start a job and return its name (it runs on; nothing waits for it).

        With `overrides`: `python -m trainer <overrides>` on this launcher, composed and checked as on the
        command line (a config that cannot run raises ValueError with the trainer's one-line message).
        With `func`: the function, called with `func_args`, on `num_nodes` nodes under `runtime` (Kubeflow's
        runtime names: torch-distributed, mpi, jax-distributed, xgboost-distributed, mlx-distributed,
        deepspeed-distributed; each sets the environment its framework reads), `nproc_per_node` processes per
        node where the runtime starts several (torchrun, mpirun); `resources_per_node` ({"cpu", "memory",
        "gpu"}: a Kubernetes node's requests and limits); `packages_to_install` pip-installed first (locally
        into the job's own environment, which inherits this one); its files in `run_dir` (default
        `outputs/<date>/<time>-<function>`). Locally a job's nodes are processes on this machine."""
        return self._backend.train(*overrides, func=func, func_args=func_args, runtime=runtime, num_nodes=num_nodes,
                                   nproc_per_node=nproc_per_node, resources_per_node=resources_per_node,
                                   packages_to_install=packages_to_install, run_dir=run_dir)

    def list_runtimes(self) -> list[RuntimeInfo]:
        """Every runtime, as it runs on this launcher (Kubeflow's `list_runtimes`)."""
        return self._backend.list_runtimes()

    def get_runtime(self, name: str) -> RuntimeInfo:
        """Runtime `name`: its framework label, nodes, device and count, and the image it runs here."""
        return self._backend.get_runtime(name)

    def get_runtime_packages(self, name: str) -> str:
        """What runtime `name`'s environment holds on this launcher: Python's version, `pip list`, and
        `nvidia-smi` where there is a GPU. Locally this machine's environment; on Docker a one-off container of
        the launcher's image; on Kubernetes a one-node job of the runtime that prints them (waited for, its log
        returned, then deleted), as Kubeflow's SDK does."""
        return self._backend.get_runtime_packages(name)

    def list_jobs(self) -> list[JobInfo]:
        return self._backend.list_jobs()

    def get_job(self, name: str) -> JobInfo:
        return self._backend.get_job(name)

    def get_job_metrics(self, name: str) -> list[dict[str, Any]]:
        """What the job has logged so far, one record a logged step, oldest first: `step`, `loss`, `lr`, the
        recipe's own metrics, `eval_loss` where it evaluated (its run's metrics.jsonl; on Kubernetes where
        `local_run_root=` mounts the pods' run directories here)."""
        return self._backend.get_job_metrics(name)

    def get_job_logs(self, name: str, rank: int = 0, follow: bool = False, step: str | None = None) -> Iterator[str]:
        """Lines of rank `rank`'s log, or of step `step`'s (Kubeflow's `node-<i>`, `get_job(name).steps`: under an
        MPI runtime `node-0` is the launcher, whose log holds every rank's output)."""
        return self._backend.get_job_logs(name, rank=rank, follow=follow, step=step)

    def wait_for_job_status(
        self, name: str, status: str | Iterable[str] = "Complete", timeout: float = 600, polling_interval: float = 2
    ) -> JobInfo:
        """Until the job is in one of `status` (Created, Running, Complete, Failed, Cancelled); RuntimeError
        when it ends otherwise, TimeoutError after `timeout` seconds."""
        return self._backend.wait_for_job_status(name, status=status, timeout=timeout,
                                                 polling_interval=polling_interval)

    def delete_job(self, name: str) -> None:
        """Stop the job and forget it (its run directory stays: nothing the job wrote is deleted)."""
        self._backend.delete_job(name)
