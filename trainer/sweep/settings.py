"""`hydra.sweeper.*` of `hydra/sweeper=optuna` (conf/hydra/sweeper/optuna.yaml), checked before any trial
starts: each setting that cannot run is a ConfigError naming it, what it holds and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launchers.options import offers
from trainer.errors import ConfigError

SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("none", "median", "hyperband", "successive_halving")
DIRECTIONS = ("minimize", "maximize")
# The keys of every line of metrics.jsonl a metric can be read from (trainer/observability/metrics.py writes
# them; eval_loss on the lines of an eval; eval_accuracy is the reward recipe's).
METRICS = (
    "eval_loss",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "mfu",
    "peak_memory_gb",
    "step_time_s",
    "eval_accuracy",
)


@dataclass(frozen=True)
class Settings:
    sampler: str
    seed: int | None
    directions: tuple[str, ...]
    metrics: tuple[str, ...]
    pruner: str
    n_trials: int
    n_jobs: int
    storage: str | None
    study_name: str
    pruner_startup_trials: int
    pruner_warmup_steps: int

    @property
    def multi_objective(self) -> bool:
        return len(self.directions) > 1


def _listed(value: Any) -> tuple[str, ...]:
    """One value, or each of a list (a ListConfig too)."""
    return (value,) if isinstance(value, str) or not hasattr(value, "__iter__") else tuple(str(v) for v in value)


def _check_int(key: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(key, value, f"a whole number >= {least}")
    return value


def settings(
    sampler: str = "tpe",
    seed: int | None = None,
    direction: Any = "minimize",
    metric: Any = "eval_loss",
    pruner: str = "none",
    n_trials: int = 20,
    n_jobs: int = 1,
    storage: str | None = None,
    study_name: str = "trainjob",
    pruner_startup_trials: int = 3,
    pruner_warmup_steps: int = 0,
) -> Settings:
    """The checked settings; ConfigError for the first that cannot run."""
    if sampler not in SAMPLERS:
        raise ConfigError("hydra.sweeper.sampler", sampler, f"one of {', '.join(SAMPLERS)}")
    if seed is not None:
        _check_int("hydra.sweeper.seed", seed, 0)
    directions = _listed(direction)
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ConfigError(
            "hydra.sweeper.direction", direction, "minimize, maximize, or a list of them (one per metric)"
        )
    metrics = _listed(metric)
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ConfigError("hydra.sweeper.metric", metric,
                          f"{unknown[0]} is not a metric of metrics.jsonl; one of {', '.join(METRICS)}")
    if len(metrics) != len(directions):
        raise ConfigError(
            "hydra.sweeper.metric", metric, f"one metric per direction: hydra.sweeper.direction lists {len(directions)}"
        )
    if pruner not in PRUNERS:
        raise ConfigError("hydra.sweeper.pruner", pruner, f"one of {', '.join(PRUNERS)}")
    if pruner != "none" and len(directions) > 1:
        raise ConfigError(
            "hydra.sweeper.pruner",
            pruner,
            f"Optuna cannot prune a study of {len(directions)} "
            "objectives (hydra.sweeper.direction is a list): set hydra.sweeper.pruner=none",
        )
    if sampler == "cmaes" and len(directions) > 1:
        raise ConfigError("hydra.sweeper.sampler", sampler, "CMA-ES optimises one objective; use tpe or random")
    return Settings(
        sampler,
        seed,
        directions,
        metrics,
        pruner,
        _check_int("hydra.sweeper.n_trials", n_trials, 1),
        _check_int("hydra.sweeper.n_jobs", n_jobs, 1),
        storage,
        str(study_name),
        _check_int("hydra.sweeper.pruner_startup_trials", pruner_startup_trials, 0),
        _check_int("hydra.sweeper.pruner_warmup_steps", pruner_warmup_steps, 0),
    )


def check_launcher(launcher: Any) -> None:
    """A trial's metrics must be readable here while it runs: the driver waits for it (launcher.wait), and on
    Kubernetes the pods' run directory is mounted here (launcher.local_run_root)."""
    if not launcher.get("wait", True):
        raise ConfigError("launcher.wait", False, "a sweep reads each trial's metrics as it runs: launcher.wait=true")
    if not offers(launcher).reads_disk_here and not launcher.get("local_run_root"):
        raise ConfigError(
            "launcher.local_run_root",
            None,
            "a sweep on Kubernetes reads each trial's metrics.jsonl "
            "from the shared storage its pods write (launcher.run_claim), mounted here at this path",
        )
