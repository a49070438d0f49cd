"""trainjob.startup: when a rank's start reached each point, from the kernel's record of real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trainjob import startup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process starts are read from /proc")


def test_a_process_start_is_when_it_was_started_to_the_clock_tick():
    tick = 1 / os.sysconf("SC_CLK_TCK")
    before = time.time()
    proc = subprocess.Popen(["sleep", "5"])
    after = time.time()
    try:
        started = startup.process_start(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert before - 2 * tick <= started <= after + 2 * tick
    assert startup.process_start(proc.pid) is None  # gone: /proc has no record of it


def test_a_rank_reports_its_start_only_under_a_node_agent(monkeypatch):
    monkeypatch.delenv(startup.AGENT_READY_ENV, raising=False)
    assert startup.marks(time.time(), time.time()) is None
    startup.mark_agent_ready()
    ready = float(os.environ[startup.AGENT_READY_ENV])
    assert abs(ready - time.time()) < 5
    imported, formed = time.time(), time.time() + 1
    marks = startup.marks(imported, formed)
    assert list(marks) == list(startup.POINTS)
    # The parent (this test's) started before this process, and this process before its imports were done.
    assert marks["agent_start"] <= marks["rank_start"] <= imported
    assert (marks["agent_ready"], marks["imports_done"], marks["group_formed"]) == (ready, imported, formed)
