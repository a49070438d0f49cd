"""This machine as a node, and a job's nodes as the launchers and the trainer's config read them:
`runtime.nnodes` (`N` nodes, or torchrun's elastic range `MIN:MAX`), a free port on this machine's loopback,
and the GPUs its processes may use."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

LOCALHOST = "127.0.0.1"


def node_range(nnodes: int | str) -> tuple[int, int]:
    """`runtime.nnodes` as (fewest, most) nodes: `N` is a fixed size (N, N), `MIN:MAX` torchrun's elastic
    range. Raises ValueError naming what is allowed."""
    text = str(nnodes).strip()
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError("must be a node count N, or MIN:MAX (an elastic range, such as 1:4)")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        raise ValueError("needs 1 <= MIN <= MAX")
    return low, high


def free_port() -> int:
    """A TCP port free on this machine's loopback now."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def local_gpus() -> int:
    """The GPUs this machine's processes may use: those `nvidia-smi -L` lists (0 without it), as many of them as
    CUDA_VISIBLE_DEVICES names where it is set, as CUDA counts them (up to its first entry that is no device:
    an empty value hides them all). Without loading torch, which the driver does not."""
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    listed = sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed
    named = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < listed)):
            break
        named += 1
    return min(named, listed)
