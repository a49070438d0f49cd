"""`Client`: Kubeflow TrainerClient's verbs over every launcher.

    client = Client("kubernetes", namespace="team-a")         # or Client("local"), Client("docker", image=...)
    name = client.train("model=1b", "+runtime=torch-distributed")   # python -m trainer, not waiting
    name = client.train(func=my_train, func_args={"lr": 3e-4}, num_nodes=2)
    name = client.train(func=fit, runtime="jax-distributed", num_nodes=2, packages_to_install=["optax"])
    client.list_runtimes(); client.get_runtime("xgboost-distributed"); client.get_runtime_packages("mpi")
    client.list_jobs(); client.get_job(name)
    for line in client.get_job_logs(name, rank=0, follow=True): print(line)
    client.get_job(name).steps; client.get_job_logs(name, step="node-0")   # Kubeflow's steps: node-<i>
    client.wait_for_job_status(name, status="Complete", timeout=3600)
    client.delete_job(name)

`train(*overrides)` runs `python -m trainer` in a subprocess (the same Hydra composition, validation and
run directory as the command line; this package never imports the trainer). `train(func=...)` ships the
function's source with the job as Kubeflow's CustomTrainer does, and runs it on every node under the runtime
it names (torchrun by default; `trainjob.runtimes`: JAX, XGBoost, MLX, DeepSpeed, MPI).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

from omegaconf import MISSING

from launchers import runtime_info
from launchers.base import JobInfo, JobState, LauncherError, LaunchSpec, OptionError, RuntimeSpec
from launchers.options import LAUNCHER_SCHEMAS, get
from trainjob import runtimes
from trainjob.run_files import RunDir
from trainjob.runtimes import mpi

FUNC_FILE = os.path.basename(RunDir.of("").func_script)  # the name it is shipped under

# Every rank of a function job keeps its output in <run_dir>/logs/rank-<RANK>.log as well (where the
# script's folder is writable: not in a pod, whose console is its log).
_TEE = """\
import os as _os, sys as _sys
class _Tee:
    # Whole lines at a time: print's text and its newline come as two writes, which another rank's output (mpirun
    # forwards every rank's to the launcher's log) would otherwise come between.
    def __init__(self, *streams): self.streams, self.pending = streams, ""
    def write(self, text):
        self.pending += text
        if "\\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\\n", 1)
            self._out(lines + "\\n")
        return len(text)
    def _out(self, text):
        for s in self.streams: s.write(text); s.flush()
    def flush(self):
        if self.pending: self._out(self.pending); self.pending = ""
_RANK_NAMES = """ + repr(mpi.CONTRACT) + """
if "MASTER_ADDR" in _os.environ and "MASTER_PORT" in _os.environ:
    # Under mpirun where the launcher named the rendezvous (here and on Docker), the rank's place in torch.distributed's
    # names too: DeepSpeed's init_distributed then keeps MASTER_ADDR and MASTER_PORT rather than finding its own from
    # MPI (port 29500, which another job here may hold). Under Kubeflow (no MASTER_ADDR) it finds them as upstream.
    for _name, _ompi in _RANK_NAMES.items():
        if _ompi in _os.environ:
            _os.environ.setdefault(_name, _os.environ[_ompi])
_RANK = next((_os.environ[k] for k in ("RANK", "OMPI_COMM_WORLD_RANK", "JAX_PROCESS_ID", "DMLC_TASK_ID")
              if k in _os.environ), "0")
try:
    _logs = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "logs")
    _os.makedirs(_logs, exist_ok=True)
    _log = open(_os.path.join(_logs, f"rank-{_RANK}.log"), "a")
    _sys.stdout, _sys.stderr = _Tee(_sys.stdout, _log), _Tee(_sys.stderr, _log)
except OSError:
    pass


def _run(func, kwargs):
    \"\"\"Call func; an exception ends the rank with one line naming the function and the exception, then the
    user's own frames (none of this script's call, of the interpreter's library or of site-packages), exit 1.\"\"\"
    import traceback as _tb
    try:
        func(**kwargs)
    except Exception as e:
        ours = (_os.path.dirname(_os.__file__), _sys.prefix, _sys.base_prefix)
        frames = [f for f in _tb.extract_tb(e.__traceback__)[1:] if not f.filename.startswith(ours)]
        detail = " ".join(str(e).split())
        print(f"error: {func.__name__} raised {type(e).__name__}{': ' + detail if detail else ''} on rank "
              f"{_RANK}", file=_sys.stderr)
        if frames:
            print("Traceback (your code, most recent call last):\\n" + "".join(_tb.format_list(frames)).rstrip(),
                  file=_sys.stderr)
        _sys.exit(1)
"""


@dataclasses.dataclass(frozen=True)
class FuncJob:
    """A function job's settings (Client.train's keywords, as Kubeflow's CustomTrainer has them)."""

    runtime: str
    num_nodes: int
    nproc_per_node: int
    resources_per_node: dict[str, Any] | None
    packages_to_install: list[str] | None


def _defaults(schema: type) -> dict[str, Any]:
    """The schema's defaults as plain values (None where it has none)."""
    out = {}
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        else:
            out[f.name] = None if f.default in (dataclasses.MISSING, MISSING) else f.default
    return out


def _hydra(value: Any) -> str:
    """`value` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_hydra(v) for v in value) + "]"
    # In Hydra's quoted strings only backslashes before a quote (an escaped one or the closing one) escape.
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", str(value))
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text) + "'"


def function_script(func: Callable, func_args: dict[str, Any] | None) -> str:
    """The source that runs `func(**func_args)`: its definition (dedented), then the call."""
    if not callable(func) or not inspect.isfunction(func):
        raise ValueError(f"func must be a plain function (def ...), not {type(func).__name__}")
    if func.__name__ != "<lambda>" and func.__code__.co_freevars:
        raise ValueError(f"func={func.__name__}: a closure over {', '.join(func.__code__.co_freevars)}, which its "
                         "source alone does not hold: define it at the top of a file and pass values in func_args")
    if func.__name__ == "<lambda>":
        raise ValueError("func=<lambda>: give a function defined with def; a lambda's source is the whole line "
                         "around it, which would not run on its own")
    args = dict(func_args or {})
    try:
        same = ast.literal_eval(repr(args)) == args
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise ValueError(
            f"func_args={args!r}: values must be literals (numbers, strings, lists, dicts, None): "
            "they travel with the function's source"
        )
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        raise ValueError(f"func={func.__name__}: its source cannot be read (defined on stdin, in a notebook "
                         "cell lost since, or by exec?): define it in a file; the job runs its source") from None
    return f"{_TEE}\n{source}\n\nif __name__ == '__main__':\n    _run({func.__name__}, {args!r})\n"


class Client:
    """Jobs on one launcher (`local`, `docker` or `kubernetes`) with that launcher's options (the keys of
    its `launcher.*` config, such as `namespace=` or `image=`)."""

    def __init__(self, launcher: str = "local", **options: Any):
        if launcher not in LAUNCHER_SCHEMAS:
            raise OptionError("launcher", launcher, f"must be one of {', '.join(LAUNCHER_SCHEMAS)}")
        schema = LAUNCHER_SCHEMAS[launcher]
        known = {f.name for f in dataclasses.fields(schema)} - {"name", "wait", "dry_run"}
        for key in options:
            if key not in known:
                raise OptionError(
                    f"launcher.{key}",
                    options[key],
                    f"unknown option of launcher={launcher}; it has {', '.join(sorted(known))}",
                )
        self.launcher, self.options = launcher, dict(options)
        self._backend = get({**_defaults(schema), **options, "name": launcher, "wait": False})

    # --- submitting ----------------------------------------------------------------------------------

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
            f"launcher={self.launcher}",
            *(f"++launcher.{k}={_hydra(v)}" for k, v in self.options.items()),
            *overrides,
            "launcher.wait=false",
            "launcher.dry_run=false",
        ]
        if run_dir:
            args.append(f"hydra.run.dir={_hydra(os.path.abspath(run_dir))}")
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
        self._check_func_job(job)
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
        return self._backend_for(job).launch(spec).name

    def _check_func_job(self, job: FuncJob) -> None:
        """A function job's settings, refused in one line before anything is written or started."""
        unit = runtime_info.unit(job.runtime)
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
        if self.launcher == "local":
            if job.runtime == "torch-distributed" and job.num_nodes != 1:
                raise ValueError(f"num_nodes={job.num_nodes}: launcher=local runs one node under "
                                 "torch-distributed (use nproc_per_node)")
            lacking = unit.missing()
            if lacking:
                raise ValueError(lacking)
            return
        if (unit.derives_runtime or self.launcher == "docker") and not self.options.get("image"):
            raise ValueError(
                f"image=None: launcher={self.launcher} runs the function in a container: give "
                f"Client({self.launcher!r}, image='...'), an image with {unit.framework}"
            )

    def _backend_for(self, job: FuncJob):
        """This client's launcher, with the job's resources per node where it has its own."""
        if not job.resources_per_node or self.launcher != "kubernetes":
            return self._backend
        res = {"cpu": None, "memory": None, "gpu": 0, **(self.options.get("resources_per_node") or {})}
        res.update({k: (int(v) if k == "gpu" else str(v)) for k, v in job.resources_per_node.items()})
        schema = LAUNCHER_SCHEMAS[self.launcher]
        return get({**_defaults(schema), **self.options, "resources_per_node": res, "name": self.launcher,
                    "wait": False})

    # --- runtimes ------------------------------------------------------------------------------------

    def list_runtimes(self) -> list[runtime_info.Runtime]:
        """Every runtime, as it runs on this launcher (Kubeflow's `list_runtimes`)."""
        return [runtime_info.describe(name, self.launcher, self.options) for name in runtimes.NAMES]

    def get_runtime(self, name: str) -> runtime_info.Runtime:
        """Runtime `name`: its framework label, nodes, device and count, and the image it runs here."""
        return runtime_info.describe(name, self.launcher, self.options)

    def get_runtime_packages(self, name: str) -> str:
        """What runtime `name`'s environment holds on this launcher: Python's version, `pip list`, and
        `nvidia-smi` where there is a GPU. Locally this machine's environment; on Docker a one-off container of
        the launcher's image; on Kubernetes a one-node job of the runtime that prints them (waited for, its log
        returned, then deleted), as Kubeflow's SDK does."""
        unit = runtime_info.unit(name)
        if self.launcher == "local":
            return runtime_info.local_packages(name)
        if self.launcher == "docker":
            if not self.options.get("image"):
                raise ValueError("image=None: launcher=docker shows the packages of its image: give Client('docker', "
                                 "image='...')")
            return runtime_info.docker_packages(self.options["image"])
        job = self.train(func=runtime_info.print_packages, runtime=name, num_nodes=1,
                         resources_per_node=None if unit.function_only else {"cpu": 1})
        try:
            self.wait_for_job_status(job, timeout=600)
            return "\n".join(self.get_job_logs(job)) + "\n"
        finally:
            self.delete_job(job)

    # --- following -----------------------------------------------------------------------------------

    def list_jobs(self) -> list[JobInfo]:
        return [job.info() for job in self._backend.list_jobs()]

    def get_job(self, name: str) -> JobInfo:
        return self._backend.job(name).info()

    def get_job_logs(self, name: str, rank: int = 0, follow: bool = False, step: str | None = None) -> Iterator[str]:
        """Lines of rank `rank`'s log, or of step `step`'s (Kubeflow's `node-<i>`, `get_job(name).steps`: under an
        MPI runtime `node-0` is the launcher, whose log holds every rank's output)."""
        if step is None:
            return self._backend.job(name).logs(rank=rank, follow=follow)
        if rank != 0:
            raise ValueError(f"rank={rank}, step={step!r}: give a rank or a step, not both")
        return self._backend.job(name).step_logs(step, follow=follow)

    def wait_for_job_status(
        self, name: str, status: str | Iterable[str] = "Complete", timeout: float = 600, polling_interval: float = 2
    ) -> JobInfo:
        """Until the job is in one of `status` (Created, Running, Complete, Failed, Cancelled); RuntimeError
        when it ends otherwise, TimeoutError after `timeout` seconds."""
        wanted = {status} if isinstance(status, str) else set(status)
        allowed = {s.value for s in JobState}
        if not wanted or not wanted <= allowed:
            raise ValueError(f"status={status!r}: must be among {', '.join(sorted(allowed))}")
        if timeout <= 0 or polling_interval <= 0:
            raise ValueError(f"timeout={timeout!r}, polling_interval={polling_interval!r}: both must be > 0")
        job = self._backend.job(name)
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
        """Stop the job and forget it (its run directory stays: nothing the job wrote is deleted)."""
        self._backend.job(name).delete()
