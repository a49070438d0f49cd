"""The `strategy` section: how the model is spread over the ranks (`strategy=ddp|fsdp2|tp|hsdp_tp|...`), and
`Degrees`, its degrees checked and filled for a world size: pure Python, so that the driver checks a config
without torch; `trainer.parallel.ParallelDims` adds the DeviceMesh they describe."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

from omegaconf import MISSING

from trainer.config.checks import one_of, require
from trainer.config.precision import AUTO, DTYPES
from trainer.errors import ConfigError

AC_MODES = ("none", "full", "selective")
DATA_PARALLEL = ("fsdp", "ddp")
# Pipeline schedules (torch.distributed.pipelining): one stage per rank, or several (interleaved).
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b",)


@dataclass
class StrategyConfig:
    """How the model is spread over the ranks: the degrees of the DeviceMesh and the options of what they
    apply (`trainer.parallel.parallelize`). The yaml files under conf/strategy are presets of these."""

    # Each must be > 0 (`trainer.config.validate` checks it before `check()`).
    POSITIVE: ClassVar[tuple[str, ...]] = ("bucket_cap_mb",)

    name: str = MISSING  # the preset's name, as reported; what runs follows from the values below
    # Degrees of the DeviceMesh; one of them may be -1: the rest of the world. tp > 1: tensor parallelism.
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    # pp > 1: pipeline parallelism, the model's blocks split into stages over pp ranks (the embedding on the
    # first stage, the norm and output layer on the last), run by the schedule pp_schedule over
    # pp_microbatches micro-batches of each local batch (null: as many as stages).
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    # Stages per rank: 1 for gpipe and 1f1b; interleaved_1f1b (null: 2) runs several, rank r holding stages
    # r, r + pp, r + 2 pp, ...
    pp_stages_per_rank: int | None = None
    # The first block of each stage but the first (stages - 1 increasing block indices); empty: an even split.
    pp_split_points: list[int] = field(default_factory=list)
    # How data-parallel ranks hold the model: fsdp (FSDP2 over dp_shard, HSDP over dp_replicate x dp_shard)
    # or ddp (a whole, plain copy per rank: DistributedDataParallel over dp_replicate; no dp_shard, no tp).
    data_parallel: str = "fsdp"
    # ddp
    bucket_cap_mb: int = 25
    # fsdp (auto: bf16 parameters on CUDA, fp32 on CPU; gradients reduced in reduce_dtype)
    reshard_after_forward: bool = True
    param_dtype: str = AUTO
    reduce_dtype: str = "fp32"
    # tp: the loss computed on vocabulary shards (the logits never gathered) when the vocabulary divides
    loss_parallel: bool = True
    # all: none | full | selective (save matmul and attention outputs, recompute the rest)
    activation_checkpointing: str = "none"
    compile: bool = False

    def check(self) -> None:
        one_of("strategy.data_parallel", self.data_parallel, DATA_PARALLEL)
        one_of("strategy.activation_checkpointing", self.activation_checkpointing, AC_MODES)
        one_of("strategy.param_dtype", self.param_dtype, (AUTO, *DTYPES))
        one_of("strategy.reduce_dtype", self.reduce_dtype, DTYPES)
        self._check_pipeline()
        if self.data_parallel == "ddp":
            for name in ("dp_shard", "tp"):
                require(getattr(self, name) == 1, f"strategy.{name}", getattr(self, name),
                        f"strategy={self.name} uses only strategy.dp_replicate; this must be 1 "
                        "(strategy.data_parallel=ddp keeps a whole, plain copy of the model on every rank)")

    def _check_pipeline(self) -> None:
        one_of("strategy.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        for name in ("pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, name)
            require(value is None or value > 0, f"strategy.{name}", value, "must be > 0, or null for the default")
        stages = self.pp_stages_per_rank
        if self.pp_schedule in MULTI_STAGE_SCHEDULES:
            require(stages is None or stages >= 2, "strategy.pp_stages_per_rank", stages,
                    f"strategy.pp_schedule={self.pp_schedule} runs several stages per rank: must be >= 2")
        else:
            require(stages in (None, 1), "strategy.pp_stages_per_rank", stages,
                    f"strategy.pp_schedule={self.pp_schedule} runs one stage per rank: must be 1 (or use "
                    "strategy.pp_schedule=interleaved_1f1b)")
        if self.data_parallel == "ddp":
            require(self.pp == 1, "strategy.pp", self.pp, f"strategy={self.name} (data_parallel=ddp) does not "
                    "compose with pipeline parallelism: use strategy=fsdp2_pp, or strategy=pp")

    def stages_per_rank(self) -> int:
        """How many pipeline stages each rank runs."""
        if self.pp_stages_per_rank is not None:
            return int(self.pp_stages_per_rank)
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES else 1


# The mesh's dimensions, outermost first (TorchTitan's order): pipeline stages across the slowest links.
NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


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

    @classmethod
    def of(cls, strategy: StrategyConfig, world_size: int) -> Degrees:
        """The strategy's degrees for `world_size` ranks, solved once per process for each combination."""
        return _solved(int(strategy.dp_replicate), int(strategy.dp_shard), int(strategy.tp), int(world_size),
                       str(strategy.data_parallel), int(strategy.pp))

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
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        require(product == self.world_size, "strategy", given,
                f"pp x dp_replicate x dp_shard x tp = {product} must equal the world size {self.world_size} (or "
                "give one of them as -1 for the rest of the world, e.g. strategy.dp_shard=-1 to shard it with FSDP2)")

    def degrees(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in NAMES}

    @property
    def dp_size(self) -> int:
        """How many ranks see different data (tensor-parallel and pipeline peers share batches)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """FSDP2 shards the model over the data-parallel ranks (HSDP when dp_replicate > 1 too)."""
        return self.data_parallel == "fsdp" and self.dp_size > 1

    @property
    def ddp(self) -> bool:
        """DistributedDataParallel averages the gradients of whole copies over dp_replicate."""
        return self.data_parallel == "ddp" and self.dp_replicate > 1


@functools.cache
def _solved(dp_replicate: int, dp_shard: int, tp: int, world_size: int, data_parallel: str, pp: int) -> Degrees:
    return Degrees(dp_replicate, dp_shard, tp, world_size, data_parallel, pp)


def mesh_degrees(strategy: StrategyConfig, world: int) -> dict[str, int]:
    """The strategy's (pp, dp_replicate, dp_shard, tp) degrees for `world` ranks, the -1 filled in."""
    return Degrees.of(strategy, world).degrees()
