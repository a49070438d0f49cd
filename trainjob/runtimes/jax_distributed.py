"""`jax-distributed` (Kubeflow Trainer's JAX plugin, `mlPolicy.jax`): one process per node, joined by
`jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
num_processes=int(os.environ["JAX_NUM_PROCESSES"]), process_id=int(os.environ["JAX_PROCESS_ID"]))`; on the CPU
its collectives run over gloo. A function-only runtime (`trainjob.runtimes.function`)."""

from __future__ import annotations

from trainjob.runtimes.function import ProcessPerNode


class JaxDistributed(ProcessPerNode):
    name = "jax-distributed"
    kubeflow_image = "nvcr.io/nvidia/jax:25.10-py3"
    index_env = "JAX_PROCESS_ID"

    def node_env(self, host: str, port: int, nnodes: int, workers_per_node: int = 1) -> dict[str, str]:
        # One process per node whatever its GPUs (the plugin's JAX_NUM_PROCESSES is numNodes).
        return {"JAX_NUM_PROCESSES": str(nnodes), "JAX_COORDINATOR_ADDRESS": f"{host}:{port}"}


RUNTIME = JaxDistributed()
