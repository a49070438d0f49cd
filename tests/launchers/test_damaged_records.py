"""A job record or a run's files damaged (cut short by a full disk, edited by hand, written by something
else) never hide the other jobs: `list` names the damaged record in a warning and lists the rest, `get`
says which file is wrong in one line, `delete` removes it; a truncated summary.json or a metrics line
that is no object reads as missing. Also the Client's refusals of what cannot run as a job."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launchers import Client, registry
from launchers.base import LauncherError
from launchers.local.backend import LocalLauncher
from trainjob.run_files import read_progress

GOOD = registry.JobRecord(name="tj-good-0000aaaa", run_dir="/nowhere", command=["true"], exit_code=0, ended=2.0)

# What a record file can hold instead of a record: a cut-off record, bytes that are no text, JSON that is
# not an object, a key of the wrong type, or another job's record.
_text = json.dumps(GOOD.__dict__ | {"name": "tj-bad-0000bbbb"})
DAMAGE = st.one_of(
    st.integers(0, len(_text) - 1).map(lambda n: _text[:n].encode()),
    st.binary(min_size=1, max_size=40).filter(lambda b: not b.strip().startswith(b"{")),
    st.sampled_from([b"[1, 2]", b"42", b'"tj-bad"', b"null"]),
    st.sampled_from([("pid", "12"), ("command", "true"), ("exit_code", 1.5), ("cancelled", 0), ("created", None),
                     ("command", [1])]).map(lambda kv: json.dumps({**json.loads(_text), kv[0]: kv[1]}).encode()),
    st.just(json.dumps({**json.loads(_text), "name": "tj-other"}).encode()),
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    GOOD.save()
    return tmp_path / "home"


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=DAMAGE)
def test_a_damaged_record_is_named_listed_around_and_deletable(home, content, caplog):
    path = home / "jobs" / "tj-bad-0000bbbb.json"
    path.write_bytes(content)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="launchers"):
        assert [r.name for r in registry.all_records()] == [GOOD.name]
    assert [r.getMessage() for r in caplog.records] == [caplog.records[0].getMessage()]
    assert str(path) in caplog.records[0].getMessage()
    client = Client("local")
    assert [j.name for j in client.list_jobs()] == [GOOD.name]
    with pytest.raises(LauncherError, match=f"job record {path} .*: python -m launchers delete tj-bad-0000bbbb"):
        client.get_job("tj-bad-0000bbbb")
    client.delete_job("tj-bad-0000bbbb")
    assert not path.exists()
    assert registry.load(GOOD.name) == GOOD


def test_unknown_keys_of_a_record_are_ignored_with_one_warning_and_get_and_list_answer(home, capfd):
    record = {**GOOD.__dict__, "name": "tj-newer-0000cccc", "queue": "gpu", "priority": 3}
    (home / "jobs" / "tj-newer-0000cccc.json").write_text(json.dumps(record))
    got = subprocess.run([sys.executable, "-m", "launchers", "get", "tj-newer-0000cccc"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, registry.HOME_ENV: str(home)})
    assert got.returncode == 0, got.stderr
    assert "state: Complete" in got.stdout
    assert got.stderr.strip() == (f"warning: job record {home / 'jobs' / 'tj-newer-0000cccc.json'}: ignoring unknown "
                                  "keys ['priority', 'queue']")
    listed = subprocess.run([sys.executable, "-m", "launchers", "list", "--json"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, registry.HOME_ENV: str(home)})
    assert listed.returncode == 0 and listed.stderr.count("ignoring unknown keys") == 1, listed.stderr
    assert [json.loads(line)["name"] for line in listed.stdout.splitlines()] == [GOOD.name, "tj-newer-0000cccc"]


def test_get_reads_the_events_beside_the_metrics_and_those_an_older_version_wrote_among_them(home, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    old = {"step": 4, "event": "reformation", "time": "t0", "world_size_before": 2, "world_size_after": 1,
           "resumed_from_step": 4}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 4, "loss": 2.0}, old, {"step": 5, "loss": 1.5}]))
    (run / "events.jsonl").write_text(json.dumps({"event": "preemption", "time": "t1", "at_step": 5,
                                                  "checkpoint": "/c/step-5"}) + "\n" + '{"event": "res')
    registry.JobRecord(name="tj-ev-0000dddd", run_dir=str(run), command=["true"], exit_code=143, ended=3.0).save()
    progress = read_progress(str(run))
    assert (progress["step"], progress["loss"]) == (5, 1.5)
    assert [e["event"] for e in progress["events"]] == ["reformation", "preemption"]
    got = subprocess.run([sys.executable, "-m", "launchers", "get", "tj-ev-0000dddd"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, registry.HOME_ENV: str(home)})
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines()[-2:] == ["reformation: t0: world size 2 -> 1, resumed from step 4",
                                            "preemption: t1: at step 5, checkpoint /c/step-5"]


def test_a_registry_where_a_file_is_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "a-file"))
    with pytest.raises(LauncherError, match=r"^TRAINJOB_HOME=.*a-file: is a file"):
        LocalLauncher({}).list_jobs()
    with pytest.raises(LauncherError, match=r"^TRAINJOB_HOME=.*a-file: is a file"):
        GOOD.save()
    assert (tmp_path / "a-file").read_text() == "x"


def test_the_client_refuses_what_cannot_run_as_a_job(tmp_path):
    client = Client("local")
    with pytest.raises(ValueError, match="func=<lambda>: give a function defined with def"):
        client.train(func=lambda: None, run_dir=str(tmp_path / "l"))
    namespace: dict = {}
    exec("def made_by_exec():\n    pass\n", namespace)  # a function without a source file
    with pytest.raises(ValueError, match="func=made_by_exec: its source cannot be read"):
        client.train(func=namespace["made_by_exec"], run_dir=str(tmp_path / "e"))
    with pytest.raises(ValueError, match=r"holds '\$\{', which the run's config would read as an interpolation"):
        client.train("train.max_steps=1", run_dir=str(tmp_path / "dollar${oc.env:HOME}x"))
    assert os.listdir(tmp_path) == []
