"""`Client`: Kubeflow TrainerClient's verbs over every launcher.

    client = Client("kubernetes", namespace="team-a")         # or Client("local"), Client("docker", image=...)
    name = client.train("model=1b", "+runtime=torch-distributed")   # python -m trainer, not waiting
    name = client.train(func=my_train, func_args={"lr": 3e-4}, num_nodes=2)
    client.list_jobs(); client.get_job(name)
    for line in client.get_job_logs(name, rank=0, follow=True): print(line)
    client.wait_for_job_status(name, status="Complete", timeout=3600)
    client.delete_job(name)

`train(*overrides)` runs `python -m trainer` in a subprocess (the same Hydra composition, validation and
run directory as the command line; this package never imports the trainer). `train(func=...)` ships the
function's source with the job as Kubeflow's CustomTrainer does, and runs it under torchrun on every node.
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

from launchers.base import JobInfo, JobState, LauncherError, LaunchSpec, OptionError, RuntimeSpec
from launchers.options import LAUNCHER_SCHEMAS, get
from trainjob.run_files import RunDir

FUNC_FILE = os.path.basename(RunDir.of("").func_script)  # the name it is shipped under

# Every rank of a function job keeps its output in <run_dir>/logs/rank-<RANK>.log as well (where the
# script's folder is writable: not in a pod, whose console is its log).
_TEE = """\
import os as _os, sys as _sys
class _Tee:
    def __init__(self, *streams): self.streams = streams
    def write(self, text):
        for s in self.streams: s.write(text); s.flush()
        return len(text)
    def flush(self):
        for s in self.streams: s.flush()
try:
    _logs = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "logs")
    _os.makedirs(_logs, exist_ok=True)
    _log = open(_os.path.join(_logs, f"rank-{_os.environ.get('RANK', '0')}.log"), "a")
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
              f"{_os.environ.get('RANK', '0')}", file=_sys.stderr)
        if frames:
            print("Traceback (your code, most recent call last):\\n" + "".join(_tb.format_list(frames)).rstrip(),
                  file=_sys.stderr)
        _sys.exit(1)
"""


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
        num_nodes: int = 1,
        nproc_per_node: int = 1,
        run_dir: str | None = None,
    ) -> str:
        """Start a job and return its name (it runs on; nothing waits for it).

        With `overrides`: `python -m trainer <overrides>` on this launcher, composed and checked as on the
        command line (a config that cannot run raises ValueError with the trainer's one-line message).
        With `func`: the function, called with `func_args`, under torchrun on `num_nodes` nodes of
        `nproc_per_node` processes each, RANK / WORLD_SIZE / LOCAL_RANK set; its files in `run_dir`
        (default `outputs/<date>/<time>-<function>`)."""
        if func is not None:
            if overrides:
                raise ValueError("give either trainer overrides or func=..., not both")
            return self._train_func(func, func_args, num_nodes, nproc_per_node, run_dir)
        if func_args is not None:
            raise ValueError("func_args needs func=...")
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

    def _train_func(
        self, func: Callable, func_args: dict[str, Any] | None, num_nodes: int, nproc_per_node: int, run_dir: str | None
    ) -> str:
        for key, value in (("num_nodes", num_nodes), ("nproc_per_node", nproc_per_node)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r}: must be a whole number >= 1")
        if self.launcher == "local" and num_nodes != 1:
            raise ValueError(f"num_nodes={num_nodes}: launcher=local runs one node (use nproc_per_node)")
        if self.launcher != "local" and not self.options.get("image"):
            raise ValueError(
                f"image=None: launcher={self.launcher} runs the function in a container: give "
                f"Client({self.launcher!r}, image='...'), an image with torch"
            )
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
            nnodes=num_nodes,
            nproc_per_node=nproc_per_node,
            runtime=RuntimeSpec.of(),
            env={"PYTHONUNBUFFERED": "1"},
            files={FUNC_FILE: script},
        )
        return self._backend.launch(spec).name

    # --- following -----------------------------------------------------------------------------------

    def list_jobs(self) -> list[JobInfo]:
        return [job.info() for job in self._backend.list_jobs()]

    def get_job(self, name: str) -> JobInfo:
        return self._backend.job(name).info()

    def get_job_logs(self, name: str, rank: int = 0, follow: bool = False) -> Iterator[str]:
        return self._backend.job(name).logs(rank=rank, follow=follow)

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
