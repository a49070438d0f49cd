"""Every code block of README.md and docs/*.md says what it is, and what is code runs here as written.

A fence names its kind: `text` (a diagram, or what a command prints), `console` (`$ command` lines, each
followed by what it prints: run, and what it prints compared), `python` and `sh` (run). A block that needs
what this machine lacks says so in an HTML comment right above its fence (`<!-- needs a cluster: ... -->`,
`<!-- needs a GPU: ... -->`), and is not run: its `python -m <module>` commands run as `--help`. A block showing
a command that fails says so the same way (`<!-- shows an error -->`), and its commands must fail. Each
document's blocks run in its order, in a directory of its own that holds what the page takes as given (README: a
sweep's directory; the data cache: Parquet files): `python` blocks as scripts, `sh` lines as commands (servers,
such as `python -m datacache serve` and `tensorboard`, started and held until the page is done; `<name>` is the
newest local job; `[...]` options left out). Two kinds of line are run elsewhere, and named so here: `python -m
trainer <overrides>` (run by `tests/test_docs_examples.py`: a dry run as written, any other as `--cfg job`, each
kind of run trained end to end in the suite), and the install and test
lines of the README's quick start (`.ci/run` runs them exactly as written, on a clean clone)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

from tests.conftest import TINY

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KINDS = ("text", "console", "python", "sh")
NEEDS = re.compile(r"<!--\s*needs (a GPU|a cluster)\b")
SHOWS_ERROR = re.compile(r"<!--\s*shows an error\b")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
# Run by .ci/run (the README's quick start) or by a test of their own (the trainer's commands).
ELSEWHERE = re.compile(r"^(python3 -m venv|\. \.venv/bin/activate|pip install|python -m trainer(\s|$))")
SERVERS = re.compile(r"^(python -m datacache serve|tensorboard)\b")


@dataclass
class Block:
    where: str
    kind: str
    needs: str | None
    text: str
    error: bool = False


def blocks(path: pathlib.Path) -> list[Block]:
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, body = i, []
        i += 1
        while not FENCE.match(lines[i]):
            body.append(lines[i])
            i += 1
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        needs = NEEDS.search(above)
        found.append(Block(f"{path.relative_to(REPO)}:{start + 1}", match.group(2), needs and needs.group(1),
                           textwrap.dedent("\n".join(body)) + "\n", bool(SHOWS_ERROR.search(above))))
        i += 1
    return found


def _commands(text: str) -> list[str]:
    """An sh block's commands: continued lines joined, comments and `[...]` options left out."""
    commands, held = [], ""
    for line in text.splitlines():
        line = held + re.split(r"\s#\s", " " + line)[0].strip()
        if line.endswith("\\"):
            held = line[:-1].rstrip() + " "
            continue
        held = ""
        if line and not line.startswith("#"):
            commands.append(re.sub(r"\s\[[^\]]*\]", "", line))
    return commands


def test_every_code_block_says_what_it_is():
    unnamed = [b.where for path in DOCUMENTS for b in blocks(path) if b.kind not in KINDS]
    assert unnamed == [], f"give these fences one of {KINDS}"


def test_the_reader_takes_markers_continued_lines_and_options_apart():
    assert _commands("python -m launchers get <name> [--json]   # state\n") == ["python -m launchers get <name>"]
    assert _commands("a \\\n    b  # c\n# d\n") == ["a b"]
    marked = [b for b in blocks(REPO / "docs" / "data-cache.md") if b.needs]
    assert [b.needs for b in marked] == ["a cluster", "a cluster"]


def _env(home: pathlib.Path, cache_dir: str) -> dict[str, str]:
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])  # the venv's commands
    return {**os.environ, "PATH": path, "TRAINJOB_HOME": str(home), "TRAINJOB_CACHE": cache_dir,
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **({} if _gpu() else {"TRITON_INTERPRET": "1"})}


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


@pytest.mark.parametrize("block", [b for p in DOCUMENTS for b in blocks(p) if b.kind == "console"],
                         ids=lambda b: b.where)
def test_every_console_example_prints_what_it_shows(block, tmp_path, cache_dir):
    shown: dict[str, list[str]] = {}
    for line in block.text.splitlines():
        if line.startswith("$ "):
            command = line[2:]
            shown[command] = []
        elif line.strip():
            shown[command].append(line.strip())
    for command, lines in shown.items():
        proc = subprocess.run(_argv(command), cwd=tmp_path, env=_env(tmp_path / "home", cache_dir),
                              capture_output=True, text=True, timeout=300)
        printed = proc.stdout + proc.stderr
        assert [line for line in lines if line not in printed] == [], f"{block.where}: {command}\n{printed[-2000:]}"


def _given_readme(work: pathlib.Path, env: dict[str, str]) -> None:
    """The sweep directory the README's report command reads: the README's own sweep, a few steps long."""
    sweep = ["-m", "optim.lr=1e-3,3e-4", *TINY, "train.max_steps=2", "train.eval_every=2", "train.eval_batches=1",
             "hydra.sweep.dir=multirun/2026-11-29/16-20-00"]
    proc = subprocess.run([sys.executable, "-m", "trainer", *sweep], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _given_data_cache(work: pathlib.Path, env: dict[str, str]) -> None:
    """`data/*.parquet`: token rows in two files, as the page's nodes serve them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (work / "data").mkdir()
    for part in range(2):
        rows = [[part * 100 + r] * 9 for r in range(48)]
        pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int32(), 9))}), work / "data" / f"{part}.parquet")


GIVEN = {"README.md": _given_readme, "docs/data-cache.md": _given_data_cache}


def _runnable(path: pathlib.Path) -> bool:
    return any(b.kind == "python" and not b.needs for b in blocks(path)) or any(
        b.kind == "sh" and not b.needs and not ELSEWHERE.match(c) for b in blocks(path) for c in _commands(b.text))


def _wait_ready(server: subprocess.Popen, argv: list[str], env: dict[str, str], work: pathlib.Path) -> None:
    """Until the server answers (a cache node: `python -m datacache ready` at its port), or a few seconds up."""
    port = argv[argv.index("--port") + 1] if "--port" in argv else None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, \
            f"{argv} ended with {server.returncode}: {server.stderr.read().decode(errors='replace')[-2000:]}"
        if port is None:
            time.sleep(3)
            return
        ready = subprocess.run([sys.executable, "-m", "datacache", "ready", f"grpc://127.0.0.1:{port}"], cwd=work,
                               env=env, capture_output=True, timeout=60)
        if ready.returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{argv} did not answer in 120 s")


def _newest_job(env: dict[str, str]) -> str:
    from launchers import Client

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINJOB_HOME", env["TRAINJOB_HOME"])
        jobs = sorted(Client("local").list_jobs(), key=lambda j: j.start_time.timestamp() if j.start_time else 0.0)
    assert jobs, "a page uses <name> before it started a job"
    return jobs[-1].name


# Documents whose examples run jobs for minutes: CI's e2e step runs them.
LONG_DOCUMENTS = {"docs/jobs-from-python.md"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.e2e) if str(p.relative_to(REPO)) in LONG_DOCUMENTS
                                  else p for p in DOCUMENTS if _runnable(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_each_documents_examples_run_as_written(path, tmp_path, cache_dir):
    work, doc = tmp_path / "work", str(path.relative_to(REPO))
    work.mkdir()
    env = _env(tmp_path / "home", cache_dir)
    if doc in GIVEN:
        GIVEN[doc](work, env)
    servers: list[subprocess.Popen] = []
    try:
        for n, block in enumerate(b for b in blocks(path) if b.kind in ("python", "sh") and not b.needs):
            if block.kind == "python":
                (work / f"example_{n}.py").write_text(block.text)
                proc = subprocess.run([sys.executable, f"example_{n}.py"], cwd=work, env=env, capture_output=True,
                                      text=True, timeout=600)
                assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
                continue
            for command in _commands(block.text):
                if ELSEWHERE.match(command):
                    continue
                argv = _argv(command.replace("<name>", _newest_job(env)) if "<name>" in command else command)
                if SERVERS.match(command):
                    servers.append(subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.PIPE, start_new_session=True))
                    _wait_ready(servers[-1], argv, env, work)
                    continue
                proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
                assert (proc.returncode != 0) == block.error, (
                    f"{block.where}: {command}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    finally:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)


MODULE = re.compile(r"^python -m ([\w.]+)")


def _needs_elsewhere() -> list[tuple[str, str]]:
    """(where, module) of each `python -m <module>` command of a block that needs what this machine lacks."""
    return [(b.where, m.group(1)) for p in DOCUMENTS for b in blocks(p) if b.kind == "sh" and b.needs
            for c in _commands(b.text) if (m := MODULE.match(c))]


@pytest.mark.e2e
def test_a_command_that_needs_a_cluster_or_a_gpu_is_still_a_command_of_ours():
    """Where a block cannot run here, each of its modules answers `--help` (the command exists, as written)."""
    found = _needs_elsewhere()
    assert found, "the pages show commands that need a cluster (docs/data-cache.md)"
    for where, module in found:
        proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0 and proc.stdout, f"{where}: python -m {module} --help\n{proc.stderr[-2000:]}"


def test_every_figure_of_the_default_run_the_pages_quote_is_the_readmes():
    """The default run's final eval loss is shown once, in the README's quick start; a page quoting a figure
    for it quotes that one."""
    loss = re.compile(r"final eval loss:? (\d+\.\d+)")
    readme = loss.findall((REPO / "README.md").read_text())
    assert len(set(readme)) == 1, readme
    quoted = {str(p.relative_to(REPO)): loss.findall(p.read_text()) for p in DOCUMENTS[1:]}
    assert {p: f for p, f in quoted.items() if set(f) - set(readme)} == {}
