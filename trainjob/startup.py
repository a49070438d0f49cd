"""When a rank's start reached each point, so that the time from a launch to the first step can be told apart
(`bench/docker.py` prints it; a rank's log holds it): its node agent's process started, the agent had imported
what it runs (`AGENT_READY_ENV`, which the agent sets for the ranks it starts), the rank's process started (the
agent's rendezvous done), the rank had imported the trainer, and its process group had formed. Each is seconds
since the epoch; a process's start is read from /proc (Linux; elsewhere None), and containers on one host share
its clock."""

from __future__ import annotations

import os
import time

# Seconds since the epoch at which the node agent (torchrun's) had imported what it runs: its ranks inherit it.
AGENT_READY_ENV = "TRAINJOB_AGENT_READY_AT"

# The points of a start, in order, as `marks` names them.
POINTS = ("agent_start", "agent_ready", "rank_start", "imports_done", "group_formed")


def mark_agent_ready() -> None:
    """In the node agent, once its imports are done: the time its ranks will report as `agent_ready`."""
    os.environ[AGENT_READY_ENV] = repr(time.time())


def process_start(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch (to the kernel's clock tick); None where /proc
    cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the name (which may hold spaces)
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    # starttime counts clock ticks since boot: the age of the process, taken from now.
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def marks(imports_done: float, group_formed: float) -> dict[str, float | None] | None:
    """This rank's start, point by point (`POINTS`); None where no node agent started it (a rank run in the
    driver's own process)."""
    ready = os.environ.get(AGENT_READY_ENV)
    if ready is None:
        return None
    return dict(zip(POINTS, (process_start(os.getppid()), float(ready), process_start(os.getpid()), imports_done,
                             group_formed), strict=True))
