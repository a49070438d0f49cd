"""A client of Kubeflow Trainer's data cache, written from its protocol (the `DataCacheDataset` of
kubeflow/trainer `examples/pytorch/data-cache/`, as `datacache.kubeflow` describes it), run as a torchrun
rank: it reads epochs with 2 and 0 DataLoader workers and writes the row ids it saw.

    torchrun --nproc-per-node 2 tests/datacache/kubeflow_client.py <head endpoint> <out dir> <epochs>

Nothing of trainjob is imported: the client is what a pod written for the `torch-distributed-with-cache`
runtime runs, and the test points it at trainjob's nodes.
"""

from __future__ import annotations

import json
import os
import sys

import pyarrow as pa
import pyarrow.flight
import torch.distributed as dist
from pyarrow._flight import FlightClient
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class DataCacheDataset(IterableDataset):
    def __init__(self, endpoint: str, seed: int = 0, batch_size: int = 128):
        self.endpoint, self.seed, self.batch_size = endpoint, seed, batch_size

    def set_epoch(self, epoch: int) -> None:
        self.seed = self.seed + epoch  # as Kubeflow's example: the epoch is added to the seed

    def __iter__(self):
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info else (0, 1)
        world_size, rank = dist.get_world_size(), dist.get_rank()
        total = num_workers * world_size
        index = (worker_id * world_size + rank + self.seed) % total
        descriptor = pa.flight.FlightDescriptor.for_path(str(index), str(total))
        flight_info = pa.flight.connect(self.endpoint).get_flight_info(descriptor)
        for endpoint in flight_info.endpoints:
            for location in endpoint.locations:
                reader = FlightClient(location.uri).do_get(endpoint.ticket)
                for chunk in reader:
                    batch = chunk.data
                    for i in range(0, batch.num_rows, self.batch_size):
                        yield batch.slice(i, self.batch_size).column("id").to_pylist()


def main() -> None:
    endpoint, out, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    seen = {}
    # The workers' epochs first: gRPC does not survive fork (apache/arrow#38617), so a DataLoader that forks
    # its workers after this process opened Flight clients itself can leave them hanging in their first call.
    for workers in (2, 0):
        dataset = DataCacheDataset(endpoint)
        for epoch in range(epochs):
            dataset.set_epoch(epoch)
            loader = DataLoader(dataset, batch_size=None, num_workers=workers)
            seen[f"{workers}/{epoch}"] = [i for ids in loader for i in ids]
    with open(os.path.join(out, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
