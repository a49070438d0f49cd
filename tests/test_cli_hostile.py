"""Every documented CLI (`python -m trainer`, `trainer.export`, `trainer.observability.report`, `python -m launchers`,
`python -m datacache`) under a hostile environment: no HOME, read-only paths (/sys refuses even root),
files where folders belong, damaged files, malformed values. Each case ends in one line naming the cause
and the key, file or value, a non-zero exit, no traceback, and nothing created or changed anywhere under
the test's folder. The runs of one module share an interpreter (tests/cli_batch.py): all are refused
before any torch work starts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, TINY

READ_ONLY = "/sys/trainjob-test"  # sysfs: no process may make a directory there


def snapshot(root) -> dict[str, tuple]:
    """Every path under `root`: a folder as such, a file with its size and modification time (a folder's
    own times change when anything is tried in it, which changes nothing a user made)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(folder, name), root)] = ("folder",)
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            out[os.path.relpath(os.path.join(folder, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def batch(module: str, runs: list[dict], timeout: float = 240) -> list[dict]:
    """Run each {"args", "cwd", "env", "unset"} as `python -m <module>` from one interpreter."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.cli_batch", module], cwd=REPO, env=env,
                          input=json.dumps(runs), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def assert_one_line(result: dict, code: int | None, *fragments: str) -> None:
    """Exit `code` (None: any non-zero), no traceback, and the error in one line holding every fragment
    (argparse's errors too: every command's parser is trainjob.cli.OneLineParser)."""
    err = result["stderr"].strip()
    assert "Traceback" not in err + result["stdout"], err[-3000:]
    assert result["returncode"] != 0 if code is None else result["returncode"] == code, (result["returncode"], err)
    lines = err.splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])


def _damaged_files(g) -> tuple:
    """Under the ground `g`: a checkpoint whose .metadata is garbage, a run whose config.yaml is empty, and
    a local job record cut short. Returns (checkpoint, run)."""
    (g / "cache").mkdir(exist_ok=True)
    ckpt = g / "ckpt" / "checkpoints" / "step-1"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    (g / "ckpt" / "config.yaml").write_text("model: {name: debug}\n")
    run = g / "runs" / "done"
    run.mkdir(exist_ok=True)
    (run / "config.yaml").write_text("")
    (run / "summary.json").write_text("{}")
    (g / "home" / "jobs").mkdir(exist_ok=True)
    (g / "home" / "jobs" / "tj-cut-1234abcd.json").write_text('{"name": "tj-cut-1234abcd", "run_')
    return ckpt, run


@pytest.fixture(scope="module")
def ground(tmp_path_factory):
    """The hostile ground: a file where folders belong, an empty job registry, Parquet files gone wrong."""
    root = tmp_path_factory.mktemp("hostile")
    (root / "a-file").write_text("not a folder")
    (root / "home").mkdir()
    (root / "runs").mkdir()
    (root / "data").mkdir()
    (root / "mixed").mkdir()
    pq.write_table(pa.table({"x": [1, 2, 3]}), root / "data" / "ints.parquet")
    pq.write_table(pa.table({"x": [1, 2, 3]}), root / "mixed" / "ints.parquet")
    pq.write_table(pa.table({"x": ["a", "b"]}), root / "mixed" / "strings.parquet")
    pq.write_table(pa.table({"ids": [[1, None, 3] * 40] * 300}), root / "data" / "null-ids.parquet")
    (root / "bad.yaml").write_text("")
    return root


def _trainer_cases(g, corpus_cache: str) -> list[tuple[dict, int, tuple[str, ...]]]:
    run = str(g / "runs" / "new" / "run")
    args = [*TINY, "train.max_steps=1", f"hydra.run.dir={run}"]
    env = {"TRAINJOB_HOME": str(g / "home"), "TRAINJOB_CACHE": str(g / "cache")}
    return [
        ({"args": args, "env": {"TRAINJOB_HOME": str(g / "home")}, "unset": ["HOME", "TRAINJOB_CACHE"]}, 2,
         ("data.cache_dir=", "Environment variable 'HOME' not found")),
        ({"args": args, "env": {**env, "TRAINJOB_CACHE": str(g / "a-file")}}, 2, ("data.cache_dir=", "is a file")),
        ({"args": args, "env": {**env, "TRAINJOB_CACHE": f"{READ_ONLY}/cache"}}, 2,
         ("data.cache_dir=", "not writable")),
        ({"args": args, "env": {**env, "TRAINJOB_HOME": str(g / "a-file" / "home")}}, 2,
         ("TRAINJOB_HOME=", "which is a file")),
        ({"args": [*args[:-1], f"hydra.run.dir={g / 'a-file' / 'run'}"], "env": env}, 2,
         ("hydra.run.dir=", "which is a file")),
        ({"args": [*args[:-1], f"hydra.run.dir={READ_ONLY}/run"], "env": env}, 2, ("hydra.run.dir=", "not writable")),
        # issue 23, item 5: a refused config outside the working directory leaves no run directory, and
        # runs/, which existed (its ctime touched by the new folder), stays
        ({"args": [*args, "train.global_batch_size=10", "train.grad_accum_steps=4"], "env": env}, 2,
         ("train.global_batch_size=10",)),
        ({"args": [*args, "train.max_steps=1e20"], "env": env}, 2, ("train.max_steps=1e20", "Integer")),
        ({"args": [*args, "train.max_steps=99999999999999999999"], "env": env}, 2,
         ("train.max_steps=99999999999999999999", "64-bit")),
        ({"args": [*args, "strategy=nope"], "env": env}, 2, ("strategy='nope': no such option", "fsdp2")),
        ({"args": [*args, "data=parquet", f"data.path={g / 'data' / 'null-ids.parquet'}", "data.text_column=null",
                   "data.tokens_column=ids"], "env": {**env, "TRAINJOB_CACHE": corpus_cache}}, 2,
         ("null-ids.parquet holds a null token id",)),
    ]


@pytest.mark.e2e
def test_every_cli_refuses_a_hostile_environment_in_one_line_and_leaves_nothing(ground, tmp_path, tmp_path_factory):
    g = ground
    ckpt, run = _damaged_files(g)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    before = snapshot(g)

    trainer_cases = _trainer_cases(g, str(tmp_path_factory.mktemp("corpus-cache")))
    groups = {
        "trainer": trainer_cases,
        "trainer.export": [
            ({"args": [str(ckpt), str(g / "a-file" / "out")]}, 2, ("OUT=", "which is a file")),
            ({"args": [str(ckpt), f"{READ_ONLY}/out"]}, 2, ("OUT=", "not writable")),
            ({"args": [str(ckpt), str(g / "exported")]}, 2, ("CHECKPOINT=", ".metadata cannot be read")),
        ],
        "trainer.observability.report": [
            ({"args": [str(run)]}, 2, ("config.yaml: not a run's config (empty)",)),
            ({"args": [str(g / "a-file")]}, 2, ("a-file: no such directory",)),
        ],
        "launchers": [
            ({"args": ["list"], "env": {"TRAINJOB_HOME": str(g / "a-file")}}, 1, ("TRAINJOB_HOME=", "is a file")),
            ({"args": ["get", "tj-cut-1234abcd"], "env": {"TRAINJOB_HOME": str(g / "home")}}, 1,
             ("tj-cut-1234abcd.json cannot be read", "python -m launchers delete tj-cut-1234abcd")),
            ({"args": ["get", "tj-none"], "env": {"TRAINJOB_HOME": str(g / "home")}, "unset": ["HOME"]}, 1,
             ("no local job 'tj-none'",)),
        ],
        "datacache": [
            ({"args": ["serve", "--source", str(g / "data" / "ints.parquet"), "--port", "99999"]}, 2,
             ("--port", "99999", "0 to 65535")),
            ({"args": ["serve", "--source", str(g / "data" / "ints.parquet"), "--host", "256.1.1.1"]}, 2,
             ("--host", "256.1.1.1")),
            ({"args": ["serve", "--source", str(g / "data" / "ints.parquet"), "--port", str(busy_port)]}, 2,
             (f"--port {busy_port}", "already in use")),
            ({"args": ["serve", "--source", str(g / "data" / "ints.parquet"), "--tls-cert", str(g / "none.pem"),
                       "--tls-key", str(g / "a-file")]}, 2, ("--tls-cert", "no such file")),
            ({"args": ["serve", "--source", str(g / "data" / "ints.parquet"), "--tls-cert", str(g / "a-file"),
                       "--tls-key", str(g / "a-file")]}, 2, ("not a PEM certificate",)),
            ({"args": ["serve", "--source", str(g / "data" / "ints.parquet"), "--port", "0", "--filter", "y == 1"]},
             2, ("--filter 'y == 1'", "(the dataset has columns x)")),
            ({"args": ["serve", "--source", str(g / "data" / "ints.parquet"), "--port", "0", "--filter", "x in 5"]},
             2, ("--filter 'x in 5'",)),
            ({"args": ["serve", "--source", str(g / "mixed"), "--port", "0"]}, 2,
             ("strings.parquet: its schema (x: string) is not that of",)),
            ({"args": ["ready", "127.0.0.1:1"]}, 2, ("'127.0.0.1:1'", "grpc://host:port")),
            ({"args": ["stat", "localhost"]}, 2, ("'localhost'", "grpc://host:port")),
        ],
    }
    try:
        for module, cases in groups.items():
            runs = [{"cwd": str(tmp_path), "env": {}, **c} for c, _, _ in cases]
            for (case, code, fragments), result in zip(cases, batch(module, runs), strict=True):
                assert_one_line(result, code, *fragments)
                assert snapshot(g) == before, (module, case["args"])
    finally:
        busy.close()
    assert not os.listdir(tmp_path)
    assert not os.path.exists(READ_ONLY)

