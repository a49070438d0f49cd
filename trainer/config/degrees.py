"""`Degrees`: a strategy's degrees checked and filled for a world size (one given as -1 is the rest of the
world). Pure Python, so that the driver checks a config without torch; `trainer.parallel.ParallelDims` adds the
DeviceMesh they describe on the rank."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.config.checks import require
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config.strategy import StrategyConfig

# The mesh's dimensions, outermost first (TorchTitan's order): pipeline stages across the slowest links.
NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Degrees:
    """The degrees of `world_size` ranks; one given as -1 is the rest of the world. Raises ConfigError,
    naming the `strategy.*` key, on degrees that cannot lay out the world."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    data_parallel: str = "fsdp"
    pp: int = 1
    ep: int = 1  # expert parallelism: groups of ep ranks within dp_shard (not a dimension of its own)
    cp: int = 1  # context parallelism: each row's tokens split over cp ranks (`trainer.parallel.context`)

    @classmethod
    def of(cls, strategy: StrategyConfig, world_size: int) -> Degrees:
        """The strategy's degrees for `world_size` ranks, solved once per process for each combination."""
        return _solved(int(strategy.dp_replicate), int(strategy.dp_shard), int(strategy.tp), int(world_size),
                       str(strategy.data_parallel), int(strategy.pp), int(strategy.ep), int(strategy.cp))

    def __post_init__(self) -> None:
        given = self.degrees()
        for name, value in given.items():
            require(value == -1 or value >= 1, f"strategy.{name}", value,
                    "must be >= 1, or -1 for the rest of the world")
        rest = [n for n, v in given.items() if v == -1]
        if len(rest) > 1:
            raise ConfigError(
                f"strategy.{rest[-1]}", -1, f"only one of {', '.join('strategy.' + n for n in NAMES)} may be -1"
            )
        known = 1
        for value in given.values():
            known *= value if value != -1 else 1
        if rest:
            require(not self.world_size % known, f"strategy.{rest[0]}", -1,
                    f"the other degrees multiply to {known}, which does not divide the world size {self.world_size}")
            object.__setattr__(self, rest[0], self.world_size // known)  # frozen: filled once, here
        product = math.prod(self.degrees().values())
        require(product == self.world_size, "strategy", given,
                f"{' x '.join(NAMES)} = {product} must equal the world size {self.world_size} (or "
                "give one of them as -1 for the rest of the world, e.g. strategy.dp_shard=-1 to shard it with FSDP2)")
        require(self.ep >= 1 and self.dp_shard % self.ep == 0, "strategy.ep", self.ep,
                f"must divide strategy.dp_shard={self.dp_shard}: the experts are split over groups of ep of FSDP2's "
                "ranks (give strategy.dp_shard=-1 to shard over the rest of the world)")

    def degrees(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in NAMES}

    @property
    def dp_size(self) -> int:
        """How many ranks see different data (tensor-, context- and pipeline-parallel peers share batches)."""
        return self.dp_replicate * self.dp_shard

    @property
    def sequence_multiple(self) -> int:
        """What a packed row's width is a multiple of: tensor parallelism's sequence split, times context
        parallelism's 2 x cp chunks."""
        return self.tp * (2 * self.cp if self.cp > 1 else 1)

    @property
    def row_peers(self) -> int:
        """How many ranks in a row of the world hold the same rows: the context- and tensor-parallel peers, the
        mesh's innermost dimensions (a gather over the world keeps every row_peers-th rank's share, one of each)."""
        return self.cp * self.tp

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the model over the data-parallel ranks and the context-parallel ones (HSDP when dp_replicate
        > 1 too)."""
        return self.data_parallel == "fsdp" and self.dp_size * self.cp > 1

    @property
    def deepspeed(self) -> bool:
        """The DeepSpeed engine (ZeRO) holds the model over the data-parallel ranks (strategy=deepspeed)."""
        return self.data_parallel == "deepspeed"

    @property
    def ddp(self) -> bool:
        """DistributedDataParallel averages the gradients of whole copies over dp_replicate."""
        return self.data_parallel == "ddp" and self.dp_replicate > 1


@functools.cache
def _solved(dp_replicate: int, dp_shard: int, tp: int, world_size: int, data_parallel: str, pp: int,
            ep: int, cp: int) -> Degrees:
    return Degrees(dp_replicate, dp_shard, tp, world_size, data_parallel, pp, ep, cp)


def mesh_degrees(strategy: StrategyConfig, world: int) -> dict[str, int]:
    """The strategy's (pp, dp_replicate, dp_shard, cp, tp) degrees for `world` ranks, the -1 filled in."""
    return Degrees.of(strategy, world).degrees()
