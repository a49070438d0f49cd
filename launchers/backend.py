"""`Backend`: every verb of the Client (Kubeflow TrainerClient's, whose backends/base.py declares them so), declared
once here and answered by each launcher's backend (`launchers/<name>/backend.py`), so that the Client delegates each
verb in one line and never asks which launcher it holds.

What every backend does alike is here: `train` (a trainer run is `python -m trainer` in a subprocess, the same
composition, validation and run directory as the command line; a function job ships the function's source and runs
it under the runtime it names), the runtimes as Kubeflow's SDK describes them, the jobs, their logs, waiting and
deleting. What differs is each backend's: the image a runtime runs and the devices a node gets there
(`runtime_image`, `device`), what a runtime's environment holds (`get_runtime_packages`), a function job's own rules
(`check_function_job`) and the launcher a job with resources of its own runs on (`for_function_job`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

from launchers.base import JobInfo, JobState, Launcher, LauncherError, LaunchSpec, RuntimeSpec
from launchers.functions import FUNC_FILE, FuncJob, function_script
from trainjob import runtimes
from trainjob.run_files import RunDir


def hydra_value(value: Any) -> str:
    """`value` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(hydra_value(v) for v in value) + "]"
    # In Hydra's quoted strings only backslashes before a quote (an escaped one or the closing one) escape.
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", str(value))
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text) + "'"


def runtime_unit(name: str) -> runtimes.Runtime:
    """The runtime called `name`; ValueError listing the runtimes where there is none."""
    if name not in runtimes.NAMES:
        raise ValueError(f"runtime={name!r}: no such runtime; the runtimes are {', '.join(runtimes.NAMES)}")
    return runtimes.get(name)


class Backend(Launcher):
    """A launcher as the Client drives it: its `options` (every key, defaults filled in) and the ones the Client was
    `given`, which a trainer run passes on as overrides."""

    options: dict[str, Any]
    given: dict[str, Any] = {}

    # --- submitting ----------------------------------------------------------------------------------

    def train(self, *overrides: str, func: Callable | None = None, func_args: dict[str, Any] | None = None,
              runtime: str = "torch-distributed", num_nodes: int = 1, nproc_per_node: int = 1,
              resources_per_node: dict[str, Any] | None = None, packages_to_install: list[str] | None = None,
              run_dir: str | None = None) -> str:
        """Start a job and return its name (`Client.train`)."""
        if func is not None:
            if overrides:
                raise ValueError("give either trainer overrides or func=..., not both")
            return self._train_func(func, func_args, FuncJob(runtime, num_nodes, nproc_per_node,
                                                             resources_per_node, packages_to_install), run_dir)
        if func_args is not None or packages_to_install is not None or resources_per_node is not None:
            raise ValueError("func_args, resources_per_node and packages_to_install need func=... (a trainer run "
                             "takes them as overrides)")
        if run_dir is not None and "${" in str(run_dir):
            raise ValueError(f"run_dir={run_dir!r}: holds '${{', which the run's config would read as an "
                             "interpolation: choose a path without it")
        return self._train_overrides(overrides, run_dir)

    def _train_overrides(self, overrides: Iterable[str], run_dir: str | None) -> str:
        args = [
            f"launcher={self.name}",
            *(f"++launcher.{k}={hydra_value(v)}" for k, v in self.given.items()),
            *overrides,
            "launcher.wait=false",
            "launcher.dry_run=false",
        ]
        if run_dir:
            args.append(f"hydra.run.dir={hydra_value(os.path.abspath(run_dir))}")
        proc = subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True)
        if proc.returncode == 2:
            raise ValueError(
                proc.stderr.strip().splitlines()[-1].removeprefix("error: ")
                if proc.stderr.strip()
                else "python -m trainer refused the config (exit 2)"
            )
        found = re.search(r"^submitted (\S+) ", proc.stdout, re.MULTILINE)
        if proc.returncode != 0 or not found:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            raise LauncherError(f"python -m trainer {' '.join(overrides)} exited with code {proc.returncode}: {tail}")
        return found.group(1)

    def _train_func(self, func: Callable, func_args: dict[str, Any] | None, job: FuncJob, run_dir: str | None) -> str:
        unit = runtime_unit(job.runtime)
        self.check_function_job(unit, job)
        script = function_script(func, func_args)
        if run_dir is None:
            run_dir = os.path.join(
                "outputs",
                datetime.now().strftime("%Y-%m-%d"),
                datetime.now().strftime("%H-%M-%S-") + func.__name__.replace("_", "-"),
            )
        run_dir = os.path.abspath(run_dir)
        path = RunDir.of(run_dir).func_script
        if os.path.exists(path):
            raise ValueError(f"run_dir={run_dir!r} already holds a {FUNC_FILE}: choose another run directory")
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(script)
        spec = LaunchSpec(
            run_dir=run_dir,
            command=[path],
            nnodes=job.num_nodes,
            nproc_per_node=job.nproc_per_node,
            runtime=RuntimeSpec.of(job.runtime),
            env={"PYTHONUNBUFFERED": "1"},
            files={FUNC_FILE: script},
            packages=tuple(job.packages_to_install or ()),
        )
        return self.for_function_job(job).launch(spec).name

    def check_function_job(self, unit: runtimes.Runtime, job: FuncJob) -> None:
        """A function job's settings, refused in one line before anything is written or started; then the rules
        of this launcher (`function_job_rules`)."""
        if not unit.function_jobs:
            raise ValueError(f"runtime={job.runtime!r} runs trainer runs only (python -m trainer runtime=...)")
        for key, value in (("num_nodes", job.num_nodes), ("nproc_per_node", job.nproc_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key}={value!r}: must be a whole number >= 1")
        packages = job.packages_to_install
        if packages is not None and (isinstance(packages, str) or not all(
                isinstance(p, str) and p.strip() and not p.startswith("-") for p in packages)):
            raise ValueError(f"packages_to_install={packages!r}: must be a list of pip requirements (strings)")
        unknown = set(job.resources_per_node or {}) - {"cpu", "memory", "gpu"}
        if unknown:
            raise ValueError(f"resources_per_node: {', '.join(sorted(unknown))}: the keys are cpu, memory, gpu")
        self.function_job_rules(unit, job)

    def function_job_rules(self, unit: runtimes.Runtime, job: FuncJob) -> None:
        """This launcher's rules on a function job: by default it runs in a container, which needs an image."""
        if self.needs_image(unit) and not self.given.get("image"):
            raise ValueError(
                f"image=None: launcher={self.name} runs the function in a container: give "
                f"Client({self.name!r}, image='...'), an image with {unit.framework}"
            )

    def needs_image(self, unit: runtimes.Runtime) -> bool:
        """Whether a function job of `unit` needs an image given here (a container's)."""
        return True

    def for_function_job(self, job: FuncJob) -> Backend:
        """The launcher that runs function job `job`: this one, unless the job has resources of its own."""
        return self

    # --- runtimes ------------------------------------------------------------------------------------

    def list_runtimes(self) -> list[runtimes.RuntimeInfo]:
        """Every runtime, as it runs on this launcher (Kubeflow's `list_runtimes`)."""
        return [self.get_runtime(name) for name in runtimes.NAMES]

    def get_runtime(self, name: str) -> runtimes.RuntimeInfo:
        """Runtime `name`: its framework label, nodes, device and count, and the image it runs here."""
        unit = runtime_unit(name)
        return unit.describe(self.runtime_image(unit), *self.device())

    @abstractmethod
    def runtime_image(self, unit: runtimes.Runtime) -> str:
        """The image runtime `unit` runs on this launcher ("local": this machine's Python)."""

    @abstractmethod
    def device(self) -> tuple[str, str]:
        """The device a node gets here and how many (Kubeflow's words: gpu, cpu, Unknown)."""

    @abstractmethod
    def get_runtime_packages(self, name: str) -> str:
        """What runtime `name`'s environment holds on this launcher: Python's version, `pip list`, and `nvidia-smi`
        where there is a GPU."""

    # --- following -----------------------------------------------------------------------------------

    def list_jobs(self) -> list[JobInfo]:
        return [job.info() for job in self.jobs()]

    def get_job(self, name: str) -> JobInfo:
        return self.job(name).info()

    def get_job_metrics(self, name: str) -> list[dict[str, Any]]:
        """The job's metrics records, one a logged step, oldest first (`Client.get_job_metrics`)."""
        return self.job(name).metrics()

    def get_job_logs(self, name: str, rank: int = 0, follow: bool = False, step: str | None = None) -> Iterator[str]:
        """Lines of rank `rank`'s log, or of step `step`'s (`Client.get_job_logs`)."""
        if step is None:
            return self.job(name).logs(rank=rank, follow=follow)
        if rank != 0:
            raise ValueError(f"rank={rank}, step={step!r}: give a rank or a step, not both")
        return self.job(name).step_logs(step, follow=follow)

    def wait_for_job_status(
        self, name: str, status: str | Iterable[str] = "Complete", timeout: float = 600, polling_interval: float = 2
    ) -> JobInfo:
        """Until the job is in one of `status` (`Client.wait_for_job_status`)."""
        wanted = {status} if isinstance(status, str) else set(status)
        allowed = {s.value for s in JobState}
        if not wanted or not wanted <= allowed:
            raise ValueError(f"status={status!r}: must be among {', '.join(sorted(allowed))}")
        if timeout <= 0 or polling_interval <= 0:
            raise ValueError(f"timeout={timeout!r}, polling_interval={polling_interval!r}: both must be > 0")
        job = self.job(name)
        deadline = time.monotonic() + timeout
        while True:
            state = job.status()
            if state.value in wanted:
                return job.info()
            if state.finished:
                raise RuntimeError(f"job {name} ended {state.value}, not {' or '.join(sorted(wanted))}")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {name} is {state.value} after {timeout:g} s, not {' or '.join(sorted(wanted))}"
                )
            time.sleep(min(polling_interval, max(0.0, deadline - time.monotonic())))

    def delete_job(self, name: str) -> None:
        """Stop the job and forget it (its run directory stays)."""
        self.job(name).delete()
