"""The `train` section: steps, batch, evals, checkpoints, resuming, preemption, and the experiment trackers
the metrics lines go to (`train.trackers`, `train.mlflow`, `train.wandb`)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import ClassVar

from trainer.config.checks import one_of, require
from trainer.config.precision import AUTO, DTYPES

TRACKERS = ("jsonl", "tensorboard", "mlflow", "wandb")
# The package each tracker needs; all come with `pip install 'trainjob[tracking]'`.
TRACKER_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
WANDB_MODES = ("online", "offline", "disabled")
# train.qat: quantization-aware training with torchao (int8 activations quantised per token at run time, int4
# weights in groups of train.qat_group_size along each row).
QAT_SCHEMES = ("none", "int8_dynamic_act_int4_weight")


@dataclass
class MlflowConfig:
    # null: a file store in the run directory (file:<run_dir>/mlruns).
    tracking_uri: str | None = None
    experiment: str = "trainjob"
    run_name: str | None = None  # null: the run directory's last two path parts


@dataclass
class WandbConfig:
    project: str = "trainjob"
    entity: str | None = None
    # null: WANDB_MODE if set, else offline (files under <run_dir>/wandb, `wandb sync` uploads them).
    mode: str | None = None
    run_name: str | None = None  # null: as for MLflow


@dataclass
class TrainConfig:
    # Each must be > 0 (`trainer.config.validate` checks it before `check()`).
    POSITIVE: ClassVar[tuple[str, ...]] = (
        "max_steps", "global_batch_size", "grad_accum_steps", "log_every", "eval_every", "eval_batches",
        "checkpoint_every", "keep_latest_k", "preemption_grace_s"
    )
    seed: int = 0
    max_steps: int = 200
    global_batch_size: int = 16
    grad_accum_steps: int = 1
    # auto: bf16 autocast on CUDA, fp32 on CPU.
    mixed_precision: str = AUTO
    # Steps between metrics lines (TorchTitan's default); only a line waits for the device.
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_latest_k: int = 2
    # Save checkpoints in the background (dcp.async_save): a step waits only for the copy of the state to CPU
    # memory; the next save, SIGTERM and the end of the run wait for the write in flight.
    checkpoint_async: bool = False
    # auto: resume from the latest checkpoint in run_dir; never: start fresh; or a checkpoint path.
    resume: str = "auto"
    progress: bool = True
    # Seconds between SIGTERM (preemption, docker stop) and SIGKILL, for the step in flight and a checkpoint:
    # the pods' terminationGracePeriodSeconds on Kubernetes, docker stop's timeout on Docker.
    preemption_grace_s: int = 30
    # Quantization-aware training (trainer.config.qat): none, or int8_dynamic_act_int4_weight (torchao), whose
    # int4 weights are quantised in groups of qat_group_size along each row.
    qat: str = "none"
    qat_group_size: int = 32
    # Where metrics lines go besides metrics.jsonl (tensorboard, mlflow, wandb), and their settings.
    trackers: list[str] = field(default_factory=lambda: ["jsonl"])
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def check(self) -> None:
        one_of("train.mixed_precision", self.mixed_precision, (AUTO, *DTYPES))
        require(0 <= self.seed < 2**32, "train.seed", self.seed, "must be in [0, 2**32)")
        if self.resume not in ("auto", "never"):
            require(os.path.isfile(os.path.join(self.resume, ".metadata")), "train.resume", self.resume,
                    "must be auto, never, or a checkpoint directory (such as <run_dir>/checkpoints/step-100, "
                    "which holds a .metadata file)")
        one_of("train.qat", self.qat, QAT_SCHEMES)
        if self.qat != "none":
            require(self.qat_group_size > 0, "train.qat_group_size", self.qat_group_size, "must be > 0")
        self._check_trackers()

    def _check_trackers(self) -> None:
        """Unknown tracker names and a W&B mode that does not exist (whether a tracker's package is installed
        depends on where the ranks run: `trainer.config.across`)."""
        chosen = list(self.trackers)
        for name in chosen:
            require(name in TRACKERS, "train.trackers", chosen,
                    f"unknown tracker {name!r}: trackers are {', '.join(TRACKERS)}")
        mode = self.wandb.mode
        require(mode is None or mode in WANDB_MODES, "train.wandb.mode", mode,
                f"must be one of {', '.join(WANDB_MODES)}, or null for offline")


def require_tracker_package(name: str, chosen: list[str]) -> None:
    """Refuse tracker `name` (of `chosen`, the train.trackers value) when its package is not installed here."""
    module = TRACKER_MODULES.get(name)
    require(not module or importlib.util.find_spec(module) is not None, "train.trackers", chosen,
            f"tracker {name} needs the {module} package, which is not installed: pip install 'trainjob[tracking]'")
