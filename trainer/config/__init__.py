"""The config schema: one dataclass per config group (registered in Hydra's ConfigStore by `compose.register`), and its
checks. No torch here: the driver checks a config without it.

The yaml files under `conf/` hold values only; types and defaults live here (Hydra rejects unknown keys and wrong
types while composing). Each section is a module holding its dataclass, the fields it declares positive (`POSITIVE`)
and, in its `check()`, the other rules on its own values: `model`, `data`, `strategy` (and `degrees`, its degrees
for a world size), `runtime`, `kernels`, `optim`, `lr_schedule`, `train`, `tracker`, `recipe`, `peft`. The rules
that span sections are in one place, `across.check`. `trainer.config.validate.validate()` (the driver's: it reads
the launchers' schemas too) runs them all and returns the typed `Config` (`schema`) with its shape
(`runtime.job_shape`); a rank types its config.yaml with `typed`. Every rule raises `trainer.errors.ConfigError`
(through the helpers of `checks`) naming the key, the value and what is allowed. A new section is a module with a
dataclass with a `check()` method, and a field of `Config`.
"""

from trainer.config.data import CACHE_KEYS, CacheConfig, DataConfig
from trainer.config.degrees import Degrees, mesh_degrees
from trainer.config.kernels import TRITON_OPS
from trainer.config.model import ModelConfig
from trainer.config.optim import OptimConfig
from trainer.config.precision import torch_dtype
from trainer.config.runtime import JobShape, job_shape
from trainer.config.schema import SCHEMAS, Config, numeric_keys, typed
from trainer.config.strategy import StrategyConfig
from trainer.errors import ConfigError

__all__ = [
    "CACHE_KEYS",
    "SCHEMAS",
    "TRITON_OPS",
    "CacheConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "Degrees",
    "JobShape",
    "ModelConfig",
    "OptimConfig",
    "StrategyConfig",
    "job_shape",
    "mesh_degrees",
    "numeric_keys",
    "torch_dtype",
    "typed",
]
