"""A run directory made this process's own before anything is written into it (`claim`, an flock held for as
long as the run runs), and given up again when the run is refused. The files in it are named in
`trainjob.run_files` (`RunDir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from trainer.errors import ConfigError
from trainjob.files import nearest_existing
from trainjob.run_files import RunDir

# The nearest ancestor of each directory Hydra is about to make that already exists (noted by the
# Preflight callback before Hydra makes it): what a refused run may remove stops there.
_existed: dict[str, str] = {}


def note_before_making(path: str) -> None:
    """Remember what of `path` exists before Hydra makes it."""
    path = os.path.abspath(path)
    _existed[path] = nearest_existing(path)


def remove_if_new(path: str) -> None:
    """Remove `path` and its parents while they are empty and were made by this process (after
    `note_before_making` of it or of a parent); a directory that existed before is never removed."""
    path = os.path.abspath(path)
    stop = next((_existed[p] for p in sorted(_existed, key=len, reverse=True)
                 if path == p or path.startswith(p.rstrip(os.sep) + os.sep)), None)
    if stop is None:
        return
    while path != stop and path.startswith(stop.rstrip(os.sep) + os.sep) and os.path.isdir(path):
        try:
            os.rmdir(path)  # only while empty
        except OSError:
            return
        path = os.path.dirname(path)


class Claim:
    """This process's hold on a run directory: an exclusive flock on `<run_dir>/.lock`, which the kernel
    drops when every process holding the descriptor (this one, and the job it hands `fds` to) has ended.
    Two drivers can never train in one directory, and a driver killed outright leaves no stale lock.

    A node of a multi-node run started here once per node (`node` is not None) holds `.lock` shared with
    the run's other nodes and `.node-<node>.lock` alone; `others` says whether another node held its slot
    when this one claimed."""

    def __init__(self, run_dir: str, fds: tuple[int, ...], node: int | None = None, others: bool = False):
        self.run_dir, self.fds, self.node, self.others = run_dir, fds, node, others

    def close(self) -> None:
        """Let go of the locks (the run has ended; a job that runs on holds its own copies of them)."""
        if _held.get(self.run_dir) is self:
            del _held[self.run_dir]
            for fd in self.fds:
                os.close(fd)

    def release(self) -> None:
        """Give the directory up (a refused run): this process's lock file goes (a node's slot: the run's
        lock stays with its other nodes), then the directory if this process made it and nothing else is in
        it."""
        with contextlib.suppress(OSError):
            paths = RunDir.of(self.run_dir)
            os.remove(paths.lock if self.node is None else paths.node_slot(self.node))
        self.close()
        remove_if_new(self.run_dir)


_held: dict[str, Claim] = {}  # the run directories this process holds: claiming one again is no conflict


def let_go(run_dir: str) -> None:
    """Close this process's hold on `run_dir`, if it has one."""
    if run_dir in _held:
        _held[run_dir].close()


def _lock(path: str, mode: int) -> int | None:
    """A descriptor of `path` holding flock `mode`, or None when another process holds a conflicting lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _holder(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read(32).strip() or "unknown"
    return "unknown"


def claim(run_dir: str, key: str = "hydra.run.dir", nodes: int = 1, node: int | None = None) -> Claim:
    """Make `run_dir` (the value of `key`) and lock it for this process, or raise ConfigError when another
    process holds it. The lock file holds the holder's pid. This process claiming it again gets its claim.

    `nodes` > 1: this process is one node of a run of up to that many, each started here on its own; it
    takes the first free node slot (slot `node` where given: `runtime.node_rank`), and is refused when all are
    taken (that one is) or a single-node run holds the directory."""
    run_dir = os.path.abspath(run_dir)
    if run_dir in _held:
        return _held[run_dir]
    if not os.path.exists(run_dir):
        note_before_making(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    paths = RunDir.of(run_dir)
    path = paths.lock
    fd = _lock(path, fcntl.LOCK_SH if nodes > 1 else fcntl.LOCK_EX)
    if fd is None:
        raise ConfigError(key, run_dir, f"an earlier attempt of this run is still running in this directory "
                          f"(started by pid {_holder(path)}; it holds {path}): wait for it to end, or choose "
                          "another run directory") from None
    if nodes == 1:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[run_dir] = Claim(run_dir, (fd,))
        return _held[run_dir]
    taken = []
    for candidate in range(nodes) if node is None else [node]:
        slot = _lock(paths.node_slot(candidate), fcntl.LOCK_EX)
        if slot is None:
            taken.append(candidate)
            continue
        os.ftruncate(slot, 0)
        os.pwrite(slot, f"{os.getpid()}\n".encode(), 0)
        others = bool(taken) or _others(run_dir, candidate, nodes, before=node is not None)
        _held[run_dir] = Claim(run_dir, (fd, slot), candidate, others=others)
        return _held[run_dir]
    os.close(fd)
    if node is not None:
        raise ConfigError("runtime.node_rank", node, f"node {node} of the run in {run_dir} is running already (pid "
                          f"{_holder(paths.node_slot(node))}): give each node its own runtime.node_rank")
    raise ConfigError("runtime.nnodes", nodes, f"all {nodes} nodes of the run in {run_dir} are running already "
                      f"(pids {', '.join(_holder(paths.node_slot(n)) for n in taken)}): wait for one to end, "
                      "or give runtime.nnodes more nodes")


def node_running(run_dir: str, node: int) -> bool:
    """Whether a process holds node `node`'s slot of the run in `run_dir`."""
    if not os.path.exists(RunDir.of(run_dir).node_slot(node)):
        return False
    fd = _lock(RunDir.of(run_dir).node_slot(node), fcntl.LOCK_SH)
    if fd is None:
        return True
    os.close(fd)
    return False


def _others(run_dir: str, node: int, nodes: int, before: bool = False) -> bool:
    """Whether a node after `node` holds its slot (one that claimed while an earlier node was gone); `before`:
    any other node (slots chosen by `runtime.node_rank`, in no order)."""
    for other in (n for n in range(0 if before else node + 1, nodes) if n != node):
        fd = _lock(RunDir.of(run_dir).node_slot(other), fcntl.LOCK_SH)
        if fd is None:
            return True
        os.close(fd)
    return False
