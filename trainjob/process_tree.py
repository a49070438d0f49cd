"""No process outlives the one that started it: the driver (`python -m trainer`) and a local job's supervisor
end every process under them before they exit, whatever the command (torchrun and its ranks, cache nodes,
`mpirun` and the ranks it starts, anything a runtime runs).

`adopt_orphans` makes this process the reaper of its descendants (Linux's PR_SET_CHILD_SUBREAPER): a process
whose parent dies (a torchrun agent killed before its ranks) is re-parented here rather than to init, so the
tree under this process holds every process it started, however deep, whatever session or process group
each put itself in. `end_all` sends SIGTERM to that tree, waits a bounded grace for it to leave (a rank
writes its checkpoint then), sends SIGKILL to what is left, and reaps each one: when it returns, none runs.
A process meant to outlive this one (a job submitted with `launcher.wait=false`, a rendezvous store the other
nodes still use) is `detach`ed, with everything under it. `die_with_parent` covers this process being killed
outright (SIGKILL), where nothing of it runs: the kernel sends its children SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

GRACE_S = 30.0
KILL_WAIT_S = 10.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_detached: set[int] = set()


class Terminated(BaseException):
    """SIGTERM arrived (see `raise_on_sigterm`); a BaseException, so that no `except Exception` swallows it."""


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def adopt_orphans() -> None:
    """Make this process the reaper of every orphan among its descendants (Linux; elsewhere nothing)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGTERM from the kernel when the process that started it dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def detach(pid: int) -> None:
    """Process `pid` (and what runs under it) is meant to outlive this one: `end_all` leaves it."""
    _detached.add(pid)


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def raise_on_sigterm() -> None:
    """SIGTERM raises `Terminated` in the main thread, so that `finally` blocks (and `end_all`) run."""
    signal.signal(signal.SIGTERM, _raise_terminated)


def _table() -> dict[int, tuple[int, bool]]:
    """pid -> (parent pid, zombie) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            table[int(entry)] = (int(fields[1]), fields[0] in ("Z", "X"))
    return table


def descendants(pid: int | None = None) -> dict[int, bool]:
    """pid -> zombie, of every process under `pid` (this one by default), but those `detach`ed and theirs."""
    root = os.getpid() if pid is None else pid
    table = _table()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = {}, [c for c in children.get(root, []) if c not in _detached]
    while todo:
        p = todo.pop()
        found[p] = table[p][1]
        todo += [c for c in children.get(p, []) if c not in _detached]
    return found


def _signal(pids, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError):  # not ours to reap (its own parent will), or reaped already
            os.waitpid(pid, os.WNOHANG)


def end_all(grace_s: float = GRACE_S) -> None:
    """End every process under this one (but the detached): SIGTERM, up to `grace_s` seconds to leave, then
    SIGKILL; return once none is left, every child reaped (or, should one not die of SIGKILL within
    KILL_WAIT_S, stuck in the kernel, after a line that names it)."""
    if not sys.platform.startswith("linux"):
        return
    deadline, signalled, killed = time.monotonic() + grace_s, set(), False
    while True:
        tree = descendants()
        alive = {pid for pid, zombie in tree.items() if not zombie}
        _reap(pid for pid in tree if pid not in alive)
        if not tree:
            return
        if time.monotonic() > deadline + KILL_WAIT_S:
            print(
                f"warning: process {', '.join(map(str, sorted(tree)))} did not end of SIGKILL within "
                f"{KILL_WAIT_S:.0f} s",
                file=sys.stderr,
            )
            return
        if not killed and time.monotonic() >= deadline:
            killed = True
        if killed:
            _signal(alive, signal.SIGKILL)
        else:
            _signal(alive - signalled, signal.SIGTERM)
            signalled |= alive
        time.sleep(0.05)
