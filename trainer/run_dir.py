"""Where a run's files live, under its run directory: the one place that names them.

config.yaml          the resolved config every rank ran
metrics.jsonl        one JSON object per logged step (rank 0)
summary.json         the final metrics (rank 0)
checkpoints/step-N/  DCP checkpoints
logs/rank-R.log      each rank's log
"""

from __future__ import annotations

import os


class RunDir:
    """The paths of the files of the run whose directory is `root`."""

    def __init__(self, root: str):
        self.root = root
        self.config = os.path.join(root, "config.yaml")
        self.metrics = os.path.join(root, "metrics.jsonl")
        self.summary = os.path.join(root, "summary.json")
        self.checkpoints = os.path.join(root, "checkpoints")
        self.logs = os.path.join(root, "logs")

    def rank_log(self, rank: int) -> str:
        return os.path.join(self.logs, f"rank-{rank}.log")
