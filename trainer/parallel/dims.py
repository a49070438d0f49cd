"""`ParallelDims`: the parallel degrees (`trainer.config.degrees.Degrees`, checked and filled there, without
torch) and the DeviceMesh they describe, built once per rank (as TorchTitan's `distributed/parallel_dims.py`).

The mesh always has the four named dimensions `pp`, `dp_replicate`, `dp_shard` and `tp` (some of size 1). Under
expert parallelism (`strategy.ep > 1`) a second mesh over the same ranks splits `dp_shard` into `dp_shard_mod_ep`
and `ep` (`expert_mesh`: `trainer.parallel.expert_parallel`).
Ranks that differ only in their `tp` or `pp` coordinates share each batch. What is applied follows from the degrees
and `strategy.data_parallel` alone (see `trainer.parallel.parallelize`): a new combination is a yaml preset.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.config.degrees import NAMES, Degrees
from trainer.config.strategy import StrategyConfig


@dataclass(frozen=True)
class ParallelDims(Degrees):
    """The degrees of `world_size` ranks, and their mesh once `build_mesh` has made it."""

    mesh: Any = field(default=None, init=False, repr=False, compare=False)
    # strategy.ep > 1: the same ranks with dp_shard split into (dp_shard_mod_ep, ep), ep the inner part
    # (TorchTitan's dp_shard_in_ep): the experts are split over `ep` and sharded by FSDP2 over the rest.
    expert_mesh: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, strategy: StrategyConfig, world_size: int) -> ParallelDims:
        return cls(**asdict(Degrees.of(strategy, world_size)))

    def build_mesh(self, device_type: str):
        """Build (once) and return the DeviceMesh over the four named dimensions."""
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device_type, tuple(self.degrees().values()), mesh_dim_names=NAMES)
            object.__setattr__(self, "mesh", mesh)  # the degrees are frozen; the mesh comes once, here
            if self.ep > 1:
                shape = (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)
                names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
                object.__setattr__(self, "expert_mesh", init_device_mesh(device_type, shape, mesh_dim_names=names))
        return self.mesh

    def data_parallel_rank(self) -> tuple[int, int]:
        """(rank, size) of this rank among those that see different data."""
        shard, replicate = self.mesh["dp_shard"], self.mesh["dp_replicate"]
        return replicate.get_local_rank() * shard.size() + shard.get_local_rank(), self.dp_size
