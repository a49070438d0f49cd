"""Where a checkpoint's files go and what makes a directory one: `<train.checkpoint_dir>/step-<N>/` (`root`: by
default the run directory's `checkpoints/`), written under `.step-<N>.partial` until whole (`paths`); a DCP
checkpoint holds its `.metadata`, DeepSpeed's the file that records its model's shapes and data order
(`DEEPSPEED_FILE`, written last); `steps` lists the checkpoints of a directory, oldest first. In an object store,
which renames nothing atomically, a checkpoint is written in place and is one only once its manifest, written last,
is there: a writer that died half way leaves a `step-<N>/` that is never taken for a checkpoint."""

from __future__ import annotations

import json
import os
import re

from trainer.checkpoint import fs
from trainer.config.train import DEEPSPEED_FILE
from trainjob.run_files import RunDir

MANIFEST = ".manifest.json"  # the manifest's name (trainer.checkpoint.manifest)
STEP_DIR = re.compile(r"^step-(\d+)$")


def root(checkpoint_dir: str, run_dir: str) -> str:
    """Where a run keeps its checkpoints: its `train.checkpoint_dir`, a path or a URL, by default
    `<run_dir>/checkpoints` ("": a config written before the key)."""
    return checkpoint_dir or RunDir.of(run_dir).checkpoints


def paths(root: str, step: int) -> tuple[str, str]:
    """Where checkpoint `step` is written (a name resume never picks) and where it is renamed to when whole (in an
    object store, both its own name: see the module's docstring)."""
    final = os.path.join(root, f"step-{step}")
    return (final if fs.remote(root) else os.path.join(root, f".step-{step}.partial")), final


def step_of(path: str) -> int | None:
    """The step of checkpoint directory `path` (`step-<N>`), or None for another name."""
    m = STEP_DIR.match(os.path.basename(path))
    return int(m.group(1)) if m else None


def steps(root: str) -> list[tuple[int, str]]:
    """(step, path) of each checkpoint in `root`, oldest first."""
    found = []
    for name in fs.listdir(root):
        m = STEP_DIR.match(name)
        if m and is_checkpoint(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def is_checkpoint(path: str) -> bool:
    if fs.remote(path):  # whole once its manifest, written last, is there
        return fs.isfile(os.path.join(path, MANIFEST)) and fs.isfile(os.path.join(path, ".metadata"))
    return os.path.isfile(os.path.join(path, ".metadata")) or is_deepspeed(path)


def is_deepspeed(path: str) -> bool:
    """Whether checkpoint `path` is DeepSpeed's (strategy=deepspeed)."""
    return not fs.remote(path) and os.path.isfile(os.path.join(path, DEEPSPEED_FILE))


def deepspeed_record(path: str) -> dict:
    """What DeepSpeed's checkpoint `path` records of its run: its model's parameter shapes, its data order."""
    with open(os.path.join(path, DEEPSPEED_FILE)) as f:
        return json.load(f)
