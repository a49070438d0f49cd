"""Where a run's files live, under its run directory: the one place that names them.

config.yaml          the resolved config every rank ran
metrics.jsonl        one JSON object per logged step (rank 0)
summary.json         the final metrics (rank 0)
checkpoints/step-N/  DCP checkpoints
logs/rank-R.log      each rank's log
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RunDir:
    root: str

    @property
    def config(self) -> str:
        return os.path.join(self.root, "config.yaml")

    @property
    def metrics(self) -> str:
        return os.path.join(self.root, "metrics.jsonl")

    @property
    def summary(self) -> str:
        return os.path.join(self.root, "summary.json")

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.root, "checkpoints")

    @property
    def logs(self) -> str:
        return os.path.join(self.root, "logs")

    def rank_log(self, rank: int) -> str:
        return os.path.join(self.logs, f"rank-{rank}.log")
