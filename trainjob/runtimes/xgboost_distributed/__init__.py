"""`xgboost-distributed` (Kubeflow Trainer's XGBoost plugin, `mlPolicy.xgboost`): every node gets
DMLC_TRACKER_URI (node 0's host), DMLC_TRACKER_PORT (29500 on a cluster), DMLC_TASK_ID (its index) and
DMLC_NUM_WORKER; as upstream, no tracker is started for the job: the function's rank 0 starts it
(`tracker.tracker()` beside this module does that, and joins every worker, in one line:
`from trainjob.runtimes.xgboost_distributed.tracker import tracker`). A function-only runtime
(`trainjob.runtimes.function`)."""

from __future__ import annotations

from trainjob.runtimes.function import ProcessPerNode


class XGBoostDistributed(ProcessPerNode):
    name = "xgboost-distributed"
    kubeflow_image = "ghcr.io/kubeflow/trainer/xgboost-runtime"
    index_env = "DMLC_TASK_ID"

    def node_env(self, host: str, port: int, nnodes: int, workers_per_node: int = 1) -> dict[str, str]:
        # The plugin's DMLC_NUM_WORKER is numNodes times the GPUs per node (1 without GPUs).
        return {"DMLC_TRACKER_URI": host, "DMLC_TRACKER_PORT": str(port),
                "DMLC_NUM_WORKER": str(nnodes * workers_per_node)}


RUNTIME = XGBoostDistributed()
