"""Hyperparameter search: `hydra/sweeper=optuna` (conf/hydra/sweeper/optuna.yaml), trainjob's Hydra sweeper on
Optuna >= 4. space.py reads the search space, settings.py checks hydra.sweeper.*, study.py makes or loads the
study, trials.py runs each trial as a process of its own, sweeper.py joins them (docs/sweeps.md)."""
