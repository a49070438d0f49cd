"""The `strategy` section: how the model is spread over the ranks (`strategy=ddp|fsdp2|tp|hsdp_tp|...`). Its
degrees solved for a world size are `trainer.config.degrees.Degrees`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from omegaconf import MISSING

from trainer.config.checks import one_of, read_by, require
from trainer.config.precision import AUTO, DTYPES

AC_MODES = ("none", "full", "selective")
DATA_PARALLEL = ("fsdp", "ddp", "deepspeed")
ZERO_STAGES = (1, 2, 3)
OFFLOAD = ("none", "cpu")
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
    dp_shard: int = 1  # FSDP's sharding degree
    tp: int = 1  # the tensor-parallel degree
    # pp > 1: pipeline parallelism, the model's blocks split into stages over pp ranks (the embedding on the
    # first stage, the norm and output layer on the last), run by the schedule pp_schedule over
    # pp_microbatches micro-batches of each local batch (null: as many as stages).
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    pp_microbatches: int | None = None  # micro-batches of each local batch through the pipeline
    # Stages per rank: 1 for gpipe and 1f1b; interleaved_1f1b (null: 2) runs several, rank r holding stages
    # r, r + pp, r + 2 pp, ...
    pp_stages_per_rank: int | None = None
    # The first block of each stage but the first (stages - 1 increasing block indices); empty: an even split.
    pp_split_points: list[int] = field(default_factory=list)
    # ep > 1: expert parallelism (TorchTitan's expert_parallel_degree): each mixture-of-experts layer's experts
    # split over groups of ep data-parallel ranks (ep divides dp_shard; it adds no ranks), tokens sent to their
    # experts' ranks by all-to-all; the experts sharded by FSDP2 over the other dp_shard / ep ranks.
    ep: int = 1
    # cp > 1: context parallelism, each row's tokens split over cp ranks (2 x cp chunks, rank r holding chunks r
    # and 2 cp - 1 - r), the keys and values all-gathered for attention (`trainer.parallel.context`).
    cp: int = 1
    # How data-parallel ranks hold the model: fsdp (FSDP2 over dp_shard, HSDP over dp_replicate x dp_shard),
    # ddp (a whole, plain copy per rank: DistributedDataParallel over dp_replicate; no dp_shard, no tp) or
    # deepspeed (the DeepSpeed engine's ZeRO over dp_replicate, under runtime=deepspeed-distributed).
    data_parallel: str = "fsdp"
    # deepspeed: ZeRO's stage: 1 partitions the optimizer's state over the ranks, 2 the gradients too, 3 the
    # parameters too (gathered for each layer's forward and backward).
    zero_stage: int = read_by("deepspeed", default=1)
    # deepspeed: none, or cpu (the optimizer's state and step in CPU memory: ZeRO-Offload).
    offload_optimizer: str = read_by("deepspeed", default="none")
    # ddp
    bucket_cap_mb: int = 25
    # fsdp (auto: bf16 parameters on CUDA, fp32 on CPU; gradients reduced in reduce_dtype)
    reshard_after_forward: bool = True
    param_dtype: str = AUTO  # fsdp: the dtype parameters are gathered and computed in (auto, bf16, fp32)
    reduce_dtype: str = "fp32"  # fsdp: the dtype gradients are reduced in
    # tp: the loss computed on vocabulary shards (the logits never gathered) when the vocabulary divides
    loss_parallel: bool = True
    # all: none | full | selective (save matmul and attention outputs, recompute the rest)
    activation_checkpointing: str = "none"
    compile: bool = False  # torch.compile each block

    def check(self) -> None:
        one_of("strategy.data_parallel", self.data_parallel, DATA_PARALLEL)
        one_of("strategy.activation_checkpointing", self.activation_checkpointing, AC_MODES)
        one_of("strategy.param_dtype", self.param_dtype, (AUTO, *DTYPES))
        one_of("strategy.reduce_dtype", self.reduce_dtype, DTYPES)
        require(self.zero_stage in ZERO_STAGES, "strategy.zero_stage", self.zero_stage,
                "must be 1, 2 or 3 (ZeRO's stages: the optimizer's state, the gradients too, the parameters too)")
        one_of("strategy.offload_optimizer", self.offload_optimizer, OFFLOAD)
        self._check_pipeline()
        self._check_experts()
        if self.data_parallel in ("ddp", "deepspeed"):
            holds = {"ddp": "a whole, plain copy of the model on every rank",
                     "deepspeed": "the model in the DeepSpeed engine, which partitions it by strategy.zero_stage"}
            for name in ("dp_shard", "cp", "tp"):
                require(getattr(self, name) == 1, f"strategy.{name}", getattr(self, name),
                        f"strategy={self.name} uses only strategy.dp_replicate; this must be 1 "
                        f"(strategy.data_parallel={self.data_parallel} keeps {holds[self.data_parallel]})")

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
        require(self.cp == 1 or self.pp == 1, "strategy.cp", self.cp, "context parallelism does not compose with "
                f"pipeline parallelism (strategy.pp={self.pp}): give strategy.cp=1 or strategy.pp=1")
        if self.data_parallel in ("ddp", "deepspeed"):
            require(self.pp == 1, "strategy.pp", self.pp, f"strategy={self.name} (data_parallel="
                    f"{self.data_parallel}) does not compose with pipeline parallelism: use strategy=fsdp2_pp, or "
                    "strategy=pp")

    def _check_experts(self) -> None:
        require(self.ep >= 1, "strategy.ep", self.ep, "must be >= 1 (1: every rank holds every expert)")
        if self.ep == 1:
            return
        require(self.data_parallel == "fsdp", "strategy.ep", self.ep, f"expert parallelism splits the experts over "
                f"FSDP2's ranks (strategy.dp_shard); strategy.data_parallel={self.data_parallel} does not compose "
                "with it: use strategy=fsdp2_ep")
        for name, what in (("pp", "pipeline"), ("tp", "tensor")):
            require(getattr(self, name) == 1, f"strategy.{name}", getattr(self, name), f"strategy.ep={self.ep} does "
                    f"not compose with {what} parallelism: use strategy.{name}=1, or strategy.ep=1")

    def stages_per_rank(self) -> int:
        """How many pipeline stages each rank runs."""
        if self.pp_stages_per_rank is not None:
            return int(self.pp_stages_per_rank)
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES else 1
