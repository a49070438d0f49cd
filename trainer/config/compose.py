"""The config `python -m trainer <overrides>` composes: the schemas registered in Hydra's ConfigStore (the
launchers' included: the driver's side), `conf/` read, and the overrides read as the command reads them; and
`compose`, for code that composes one without the command (the tests, the benches)."""

from __future__ import annotations

import os

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from launchers import LAUNCHER_SCHEMAS, SchedulerConfig
from trainer.config.schema import Config
from trainer.errors import ConfigError
from trainjob import runtimes

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")
# The groups conf/config.yaml declares with a null default (none chosen unless asked).
OPTIONAL_GROUPS = ("runtime",)


def register() -> None:
    """Put the schemas into Hydra's ConfigStore; `conf/config.yaml` starts its defaults with `schema`."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for name, schema in LAUNCHER_SCHEMAS.items():
        cs.store(name=f"launcher_schema_{name}", node=schema)  # not a launcher option: no group
    cs.store(name="scheduler_schema", node=SchedulerConfig)  # named by each conf/scheduler option
    for name, schema in runtimes.schemas().items():
        cs.store(name=f"runtime_schema_{name}", node=schema)  # named by conf/runtime/<name>.yaml


# Keys that moved to another section: an override of the old key is refused naming the new one.
MOVED_KEYS = {"optim.warmup_steps": "lr_schedule.warmup_steps", "optim.min_lr_ratio": "lr_schedule.min_lr_factor",
              "train.trackers": "tracker.report_to", "train.mlflow": "tracker.mlflow", "train.wandb": "tracker.wandb"}


def plain_group_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with `+runtime=...` read as `runtime=...`: the group is in the defaults list (null), so Hydra
    takes the plain form and refuses the appending one, which was the spelling before and still works. An
    override of a key that moved (`MOVED_KEYS`) raises ConfigError naming where it went."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        old = next((k for k in MOVED_KEYS if key == k or key.startswith(k + ".")), None)
        if old is not None:
            new = MOVED_KEYS[old] + key[len(old):]
            raise ConfigError(key, value, f"moved to {new} (the {new.split('.')[0]} group): give that key")
    return [o[1:] if o.startswith(tuple(f"+{g}=" for g in OPTIONAL_GROUPS)) else o for o in overrides]


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The composed (not yet validated) config of `python -m trainer *overrides`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=plain_group_overrides(list(overrides)))
