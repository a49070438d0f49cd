"""The `tracker` section: where rank 0 sends each metrics line besides `<run_dir>/metrics.jsonl` (`jsonl`,
always written), and the trackers' settings. `tracker=tensorboard|mlflow|wandb` picks one; `report_to` (the name
and form of Hugging Face's and TRL's `report_to`) lists several, `tracker.report_to=[tensorboard,mlflow]`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from omegaconf import MISSING

from trainer.config.checks import one_of, require

TRACKERS = ("jsonl", "tensorboard", "mlflow", "wandb")
# The package each tracker needs; all come with `pip install 'trainjob[tracking]'`.
TRACKER_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class MlflowConfig:
    # null: a file store in the run directory (file:<run_dir>/mlruns).
    tracking_uri: str | None = None
    experiment: str = "trainjob"  # the MLflow experiment
    run_name: str | None = None  # null: the run directory's last two path parts


@dataclass
class WandbConfig:
    project: str = "trainjob"  # the W&B project
    entity: str | None = None  # the W&B team or user (null: the account's default)
    # null: WANDB_MODE if set, else offline (files under <run_dir>/wandb, `wandb sync` uploads them).
    mode: str | None = None
    run_name: str | None = None  # null: as for MLflow


@dataclass
class TrackerConfig:
    name: str = MISSING  # the option chosen: jsonl (metrics.jsonl alone), tensorboard, mlflow or wandb
    # Where metrics lines go (metrics.jsonl always): jsonl, tensorboard, mlflow, wandb.
    report_to: list[str] = field(default_factory=lambda: ["jsonl"])
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def check(self) -> None:
        """Unknown tracker names and a W&B mode that does not exist (whether a tracker's package is installed
        depends on where the ranks run: `trainer.config.across`)."""
        one_of("tracker.name", self.name, TRACKERS)
        chosen = list(self.report_to)
        for name in chosen:
            require(name in TRACKERS, "tracker.report_to", chosen,
                    f"unknown tracker {name!r}: trackers are {', '.join(TRACKERS)}")
        mode = self.wandb.mode
        require(mode is None or mode in WANDB_MODES, "tracker.wandb.mode", mode,
                f"must be one of {', '.join(WANDB_MODES)}, or null for offline")


def require_tracker_package(name: str, chosen: list[str]) -> None:
    """Refuse tracker `name` (of `chosen`, the tracker.report_to value) when its package is not installed here."""
    module = TRACKER_MODULES.get(name)
    require(not module or importlib.util.find_spec(module) is not None, "tracker.report_to", chosen,
            f"tracker {name} needs the {module} package, which is not installed: pip install 'trainjob[tracking]'")
