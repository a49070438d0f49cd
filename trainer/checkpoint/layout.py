"""Where a checkpoint's files go and what makes a directory one: `checkpoints/step-<N>/`, written under
`.step-<N>.partial` until whole (`paths`); a DCP checkpoint holds its `.metadata`, DeepSpeed's the file that
records its model's shapes and data order (`DEEPSPEED_FILE`, written last); `steps` lists the checkpoints of a
directory, oldest first."""

from __future__ import annotations

import json
import os
import re

from trainer.config.train import DEEPSPEED_FILE

STEP_DIR = re.compile(r"^step-(\d+)$")


def paths(root: str, step: int) -> tuple[str, str]:
    """Where checkpoint `step` is written (a name resume never picks) and where it is renamed to when whole."""
    return os.path.join(root, f".step-{step}.partial"), os.path.join(root, f"step-{step}")


def step_of(path: str) -> int | None:
    """The step of checkpoint directory `path` (`step-<N>`), or None for another name."""
    m = STEP_DIR.match(os.path.basename(path))
    return int(m.group(1)) if m else None


def steps(root: str) -> list[tuple[int, str]]:
    """(step, path) of each checkpoint in `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and is_checkpoint(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) or is_deepspeed(path)


def is_deepspeed(path: str) -> bool:
    """Whether checkpoint `path` is DeepSpeed's (strategy=deepspeed)."""
    return os.path.isfile(os.path.join(path, DEEPSPEED_FILE))


def deepspeed_record(path: str) -> dict:
    """What DeepSpeed's checkpoint `path` records of its run: its model's parameter shapes, its data order."""
    with open(os.path.join(path, DEEPSPEED_FILE)) as f:
        return json.load(f)
