"""Many `python -m <module> *args` runs from one interpreter, for tests of refusals, whose time is mostly the
interpreter importing torch and Hydra: the parent imports the module once, then forks one child per run,
which runs the module as `python -m` does (`runpy`, `sys.argv`), in its own directory and environment, with
its own stdout and stderr, and exits with the module's exit code. Children run one after another.

    python -m tests.cli_batch <module>    stdin: [{"args", "cwd", "env", "unset" (optional)}, ...]
                                          stdout: [{"returncode", "stdout", "stderr"}, ...]
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import sys
import tempfile
import traceback


def _exit_code(e: SystemExit) -> int:
    """What the interpreter makes of `SystemExit(code)`: None is 0, a number itself, anything else printed, 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(module: str, run: dict, out: int, err: int) -> int:
    os.chdir(run["cwd"])
    os.environ.update(run["env"])
    for name in run.get("unset", []):  # a hostile environment: HOME not set, say
        os.environ.pop(name, None)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = [module, *run["args"]]  # runpy puts the module's file in argv[0], as `python -m` does
    sys.modules.pop(f"{module}.__main__", None)  # run afresh as __main__, as in a new interpreter
    if importlib.util.find_spec(module).submodule_search_locations is None:
        sys.modules.pop(module, None)  # a plain module (trainer.export) runs as __main__, not as imported
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def run_all(module: str, runs: list[dict]) -> list[dict]:
    package = importlib.util.find_spec(module).submodule_search_locations is not None
    main = f"{module}.__main__" if package else module  # `python -m pkg` runs pkg.__main__; a module runs itself
    importlib.import_module(main)  # its imports are what the children share
    results = []
    for run in runs:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os._exit(_child(module, run, out.fileno(), err.fileno()))
            _, status = os.waitpid(pid, 0)
            out.seek(0)
            err.seek(0)
            results.append({"returncode": os.waitstatus_to_exitcode(status),
                            "stdout": out.read().decode(errors="replace"),
                            "stderr": err.read().decode(errors="replace")})
    return results


if __name__ == "__main__":
    json.dump(run_all(sys.argv[1], json.load(sys.stdin)), sys.stdout)
