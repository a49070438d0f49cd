"""A function job's script (Client.train(func=...), as Kubeflow's CustomTrainer ships it): `function_script`, the
function's source and its call, after a prologue that keeps each rank's output in <run_dir>/logs as well and names
its rank as torch.distributed does under every runtime; `FuncJob`, the job's settings."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
from collections.abc import Callable
from typing import Any

from trainjob import runtimes
from trainjob.run_files import RunDir

FUNC_FILE = os.path.basename(RunDir.of("").func_script)  # the name it is shipped under

# What the runtimes' agents name a rank's place by, as torch.distributed's names (mpirun's OMPI_COMM_WORLD_*).
_RANK_NAMES = {k: v for name in runtimes.NAMES for k, v in runtimes.get(name).rank_names.items()}

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
_RANK_NAMES = """ + repr(_RANK_NAMES) + """
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
