"""Elastic training (`runtime.nnodes=MIN:MAX`): nodes are the same command run once per node on this machine,
with real torchrun agents on loopback. A node whose agent is SIGKILLed takes its ranks with it; the nodes left
re-form the group, resume from the newest checkpoint at the new world size, and the run ends at the losses of
an uninterrupted one-node run; a node started later joins at the next re-formation. The run's metrics record
each re-formation and the data position of every step, so that no row is trained twice or skipped."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from launchers.base import run_name
from tests.conftest import TINY, compose_refused, read_summary
from trainjob.run_files import read_events

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow, pytest.mark.e2e]
STEPS, BATCH = 60, 8
ARGS = [*TINY, f"train.max_steps={STEPS}", f"train.eval_every={STEPS}", "train.checkpoint_every=1",
        "+runtime=torch-distributed", "runtime.nproc_per_node=1", "runtime.max_restarts=3",
        "runtime.last_call_timeout=3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(cache_dir: str, cwd, *args: str) -> subprocess.Popen:
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=str(cwd), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError):  # a line being written
                out.append(json.loads(line))
    return out


def _wait(run_dir, nodes: list[subprocess.Popen], until, what: str, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until(_records(run_dir)):
            return
        if all(n.poll() is not None for n in nodes):
            break
        time.sleep(0.1)
    raise AssertionError(f"{what}: not seen in {run_dir}; last records {_records(run_dir)[-3:]}")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def agent_of(driver: subprocess.Popen) -> int:
    """The pid of the torchrun agent that the node driver `driver` started (under its supervisor)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        todo = _children(driver.pid)
        while todo:
            pid = todo.pop()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"trainjob.runtimes.torch_distributed.torchrun" in f.read().split(b"\0"):
                    return pid
            todo += _children(pid)
        time.sleep(0.1)
    raise AssertionError(f"no torchrun agent under node driver {driver.pid}")


def ranks_of(agent: int) -> list[int]:
    """The pids of the ranks that torchrun's agent `agent` started."""
    ranks = []
    for pid in _children(agent):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"trainer.worker" in f.read().split(b"\0"):
                ranks.append(pid)
    assert ranks, f"no ranks under torchrun agent {agent}"
    return ranks


def _sigterm_pending(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        pending = next(line.split()[1] for line in f if line.startswith("ShdPnd:"))
    return bool(int(pending, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("elastic-reference")
    proc = _node(cache_dir, root, *ARGS, "runtime.nnodes=1", f"hydra.run.dir={root / 'run'}")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return read_summary(str(root / "run"))


def test_a_lost_node_and_a_late_one_reform_the_group_and_end_at_the_one_node_losses(one_node, cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    elastic = [*ARGS, "runtime.nnodes=1:2", f"runtime.rdzv_endpoint=127.0.0.1:{_free_port()}",
               f"hydra.run.dir={run_dir}"]
    first, second = _node(cache_dir, tmp_path, *elastic), _node(cache_dir, tmp_path, *elastic)
    nodes = [first, second]
    _wait(run_dir, nodes, lambda rs: any(r.get("world_size") == 2 and r["step"] >= 10 for r in rs),
          "two nodes at step 10")
    # The node whose driver started the rendezvous store goes: the store outlives it.
    os.kill(agent_of(first), signal.SIGKILL)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 1 and "error: run " in out, out[-2000:]
    _wait(run_dir, nodes, lambda rs: any(e["event"] == "reformation" for e in read_events(str(run_dir))),
          "a re-formation")
    _wait(run_dir, nodes, lambda rs: any(r.get("world_size") == 1 for r in rs), "one node training")
    # The survivor's rank waits (stopped) for the late node, which must not find the run finished: its agent
    # tells the rank to stop (SIGTERM, pending while it is stopped) once the late node waits to join.
    ranks = ranks_of(agent_of(second))
    for rank in ranks:
        os.kill(rank, signal.SIGSTOP)
    late = _node(cache_dir, tmp_path, *elastic)  # takes the lost node's slot, joins at the next re-formation
    nodes.append(late)
    deadline = time.monotonic() + 180
    while not any(_sigterm_pending(rank) for rank in ranks):
        assert time.monotonic() < deadline and late.poll() is None, "the late node was never waited for"
        time.sleep(0.1)
    for rank in ranks:
        os.kill(rank, signal.SIGCONT)
    for node in (second, late):
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-3000:]

    steps, every = _records(run_dir), read_events(str(run_dir))
    assert all("step" not in e for e in every), every  # metrics.jsonl: one record per step; events apart
    # The survivor was told to stop for the late node: it checkpointed (a preemption), then re-formed.
    assert [e["event"] for e in every] == ["reformation", "preemption", "reformation"], every
    events = [e for e in every if e["event"] == "reformation"]
    assert [(e["world_size_before"], e["world_size_after"]) for e in events] == [(2, 1), (1, 2)]
    # Every step once, in order, each on the rows after the last step's: nothing trained twice or skipped.
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["samples_seen"] for r in steps] == [s * BATCH for s in range(1, STEPS + 1)]
    sizes = [r["world_size"] for r in steps]
    lost, joined = sizes.index(1), len(sizes) - sizes[::-1].index(1)
    assert sizes == [2] * lost + [1] * (joined - lost) + [2] * (STEPS - joined)
    assert [e["resumed_from_step"] for e in events] == [lost, joined]
    # `python -m launchers get` shows them (the surviving node's job, as any node's).
    name = f"{run_name(str(run_dir), 44)}-node-1"
    got = subprocess.run([sys.executable, "-m", "launchers", "get", name], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    shown = [line for line in got.stdout.splitlines() if line.startswith("reformation: ")]
    assert [line.split(": ", 2)[2] for line in shown] == [
        f"world size 2 -> 1, resumed from step {lost}", f"world size 1 -> 2, resumed from step {joined}"]
    ours = read_summary(str(run_dir))
    for key in ("final_train_loss", "final_eval_loss"):
        assert math.isclose(ours[key], one_node[key], rel_tol=1e-5), (key, ours[key], one_node[key])
    assert ours["world_size"] == 2 and ours["steps"] == STEPS


def test_two_nodes_started_with_their_ranks_equal_one_and_a_node_killed_and_started_again_resumes(one_node, cache_dir,
                                                                                                 tmp_path):
    run_dir = tmp_path / "run"
    fixed = [*ARGS, "runtime.nnodes=2", f"runtime.rdzv_endpoint=127.0.0.1:{_free_port()}", "runtime.rdzv_timeout=120",
             f"hydra.run.dir={run_dir}"]
    # As torchrun users start them: node 1 first, each with its own runtime.node_rank, the rest the same.
    second = _node(cache_dir, tmp_path, *fixed, "runtime.node_rank=1")
    first = _node(cache_dir, tmp_path, *fixed, "runtime.node_rank=0")
    _wait(run_dir, [first, second], lambda rs: any(r.get("world_size") == 2 and r["step"] >= 10 for r in rs),
          "two nodes at step 10")
    os.kill(agent_of(second), signal.SIGKILL)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 1, out[-2000:]
    again = _node(cache_dir, tmp_path, *fixed, "runtime.node_rank=1")  # the same command: it rejoins
    for node in (first, again):
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-3000:]
    steps = _records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)) and {r["world_size"] for r in steps} == {2}
    assert [e["event"] for e in read_events(str(run_dir))] == ["reformation"]
    assert (run_dir / "config.yaml").read_text().count("node_rank: null") == 1  # a per-node key is not saved
    ours = read_summary(str(run_dir))
    for key in ("final_train_loss", "final_eval_loss"):
        assert math.isclose(ours[key], one_node[key], rel_tol=1e-5), (key, ours[key], one_node[key])


def test_a_node_refused_for_another_config_leaves_the_waiting_node_to_end_in_one_line(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    # Node 0 must still be waiting when node 1 is refused: node 1's start (composition and checks) took 25 s on a
    # loaded CI machine, by when a 10 s rendezvous had ended node 0 and freed its slot.
    fixed = [*ARGS, "runtime.nnodes=2", f"runtime.rdzv_endpoint=127.0.0.1:{_free_port()}", "runtime.rdzv_timeout=40",
             f"hydra.run.dir={run_dir}"]
    first = _node(cache_dir, tmp_path, *fixed, "runtime.node_rank=0")
    deadline = time.monotonic() + 120
    while not (run_dir / "logs").exists():  # node 0 saved its config and launched
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-2000:]
        time.sleep(0.1)
    other = subprocess.run([sys.executable, "-m", "trainer", *fixed, "runtime.node_rank=1", "train.seed=7"],
                           cwd=tmp_path, env={**os.environ, "TRAINJOB_CACHE": cache_dir}, capture_output=True,
                           text=True, timeout=120)
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "another node of this run trains from" in other.stderr
    out, _ = first.communicate(timeout=180)
    assert first.returncode == 1, out[-2000:]
    assert out.strip().splitlines()[-1] == (
        f"error: runtime.rdzv_timeout=40: the rendezvous at {fixed[-3].split('=')[1]} waited 40 s for 2 nodes: 1 "
        "joined (node 0), node 1 never did (refused, or not started: start each node with the same command)")
    assert "Traceback" not in out


@pytest.mark.parametrize(("nnodes", "extra", "message"), [
    ("2:1", [], "runtime.nnodes='2:1': needs 1 <= MIN <= MAX"),
    ("0:2", [], "runtime.nnodes='0:2': needs 1 <= MIN <= MAX"),
    ("1-2", [], "runtime.nnodes='1-2': must be a node count N, or MIN:MAX (an elastic range, such as 1:4)"),
    ("1:4", ["runtime.nproc_per_node=1", "train.global_batch_size=8"],
     "train.global_batch_size=8: must be divisible by data-parallel size x train.grad_accum_steps = 3 x 1 = 3 at 3 "
     "node(s) of runtime.nnodes=1:4"),
    ("2:3", ["runtime.nproc_per_node=2", "train.global_batch_size=8"],
     "train.global_batch_size=8: must be divisible by data-parallel size x train.grad_accum_steps = 6 x 1 = 6"),
    ("1:2", ["runtime.node_rank=1"], "runtime.node_rank=1: runtime.nnodes=1:2 is an elastic range, whose "
     "rendezvous assigns each node its rank: leave runtime.node_rank unset"),
    ("1:2", ["launcher=kubernetes", "launcher.image=x", "launcher.run_claim=runs"],
     "runtime.nnodes='1:2': an elastic range runs on launcher=local or docker"),
    ("1:2", ["runtime.keep_alive_max_attempt=2"], "runtime.keep_alive_max_attempt=2: must be >= 3: a live node's "
     "heartbeat comes every runtime.keep_alive_interval plus the store's round trip"),
])
def test_elastic_ranges_that_cannot_run_are_refused(nnodes, extra, message, tmp_path, capsys):
    err = compose_refused(tmp_path, capsys, "+runtime=torch-distributed", f"runtime.nnodes={nnodes}",
                          "runtime.rdzv_endpoint=h:1", *extra)
    assert err.count("\n") == 1 and message in err, err
