"""The parallel degrees, checked and filled in one place, and the DeviceMesh they describe (as TorchTitan's
`distributed/parallel_dims.py`).

The mesh always has the three named dimensions `dp_replicate`, `dp_shard` and `tp` (some of size 1).
Ranks that differ only in their `tp` coordinate share each batch. What is applied follows from the degrees
and `strategy.data_parallel` alone (see `trainer.parallel.parallelize`): a new combination is a yaml preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.config.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import StrategyConfig

NAMES = ("dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    """The degrees of `world_size` ranks; one given as -1 is the rest of the world. Raises ConfigError,
    naming the `strategy.*` key, on degrees that cannot lay out the world."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    data_parallel: str = "fsdp"
    mesh: Any = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(cls, strategy: StrategyConfig, world_size: int) -> ParallelDims:
        return cls(*(int(getattr(strategy, n)) for n in NAMES), world_size, strategy.data_parallel)

    def __post_init__(self) -> None:
        given = self.degrees()
        for name, value in given.items():
            if value != -1 and value < 1:
                raise ConfigError(f"strategy.{name}", value, "must be >= 1, or -1 for the rest of the world")
        rest = [n for n, v in given.items() if v == -1]
        if len(rest) > 1:
            raise ConfigError(
                f"strategy.{rest[-1]}", -1, f"only one of {', '.join('strategy.' + n for n in NAMES)} may be -1"
            )
        known = 1
        for value in given.values():
            known *= value if value != -1 else 1
        if rest:
            if self.world_size % known:
                raise ConfigError(
                    f"strategy.{rest[0]}",
                    -1,
                    f"the other degrees multiply to {known}, which does not divide the world size {self.world_size}",
                )
            setattr(self, rest[0], self.world_size // known)
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                "strategy",
                given,
                f"dp_replicate x dp_shard x tp = {product} must equal the world size {self.world_size}",
            )

    def degrees(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in NAMES}

    @property
    def dp_size(self) -> int:
        """How many ranks see different data (tensor-parallel peers share batches)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the model over the data-parallel ranks (HSDP when dp_replicate > 1 too)."""
        return self.data_parallel == "fsdp" and self.dp_size > 1

    @property
    def ddp(self) -> bool:
        """DistributedDataParallel averages the gradients of whole copies over dp_replicate."""
        return self.data_parallel == "ddp" and self.dp_replicate > 1

    def build_mesh(self, device_type: str):
        """Build (once) and return the DeviceMesh over the three named dimensions."""
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device_type, tuple(self.degrees().values()), mesh_dim_names=NAMES)
        return self.mesh

    def data_parallel_rank(self) -> tuple[int, int]:
        """(rank, size) of this rank among those that see different data."""
        shard, replicate = self.mesh["dp_shard"], self.mesh["dp_replicate"]
        return replicate.get_local_rank() * shard.size() + shard.get_local_rank(), self.dp_size
