"""`tracker()`: an `xgboost-distributed` function's workers joined in one line, as Kubeflow's
XGBoost guide does by hand: rank 0 (DMLC_TASK_ID 0) starts XGBoost's RabitTracker for DMLC_NUM_WORKER workers
on DMLC_TRACKER_PORT, every worker joins it through `xgboost.collective.CommunicatorContext`, and rank 0 waits
for the tracker at the end.

    from trainjob.runtimes.xgboost_distributed.tracker import tracker

    def train():
        import xgboost as xgb
        with tracker():
            booster = xgb.train({"tree_method": "hist"}, dtrain, num_boost_round=10)

It reads only the environment the runtime sets (imports nothing of the project beyond this module, and xgboost
only when called), so it also runs in an image that holds no more than xgboost and this file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def tracker(timeout: int = 300) -> Iterator[int]:
    """Join this worker to the job's XGBoost collective (rank 0 hosting the tracker); yields the worker's rank.
    `timeout`: seconds the tracker waits for every worker to connect."""
    from xgboost import collective
    from xgboost.tracker import RabitTracker

    missing = [k for k in ("DMLC_TRACKER_URI", "DMLC_TRACKER_PORT", "DMLC_TASK_ID", "DMLC_NUM_WORKER")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: run this under runtime='xgboost-distributed'")
    rank, workers = int(os.environ["DMLC_TASK_ID"]), int(os.environ["DMLC_NUM_WORKER"])
    uri, port = os.environ["DMLC_TRACKER_URI"], int(os.environ["DMLC_TRACKER_PORT"])
    rabit = None
    if rank == 0:
        # Workers take their ranks in task order, so that worker i is DMLC_TASK_ID i (its share of the rows).
        rabit = RabitTracker(n_workers=workers, host_ip="0.0.0.0", port=port, sortby="task", timeout=timeout)
        rabit.start()
    try:
        with collective.CommunicatorContext(dmlc_tracker_uri=uri, dmlc_tracker_port=port,
                                            dmlc_task_id=str(rank)):
            yield rank
    finally:
        if rabit is not None:
            rabit.wait_for(timeout)
