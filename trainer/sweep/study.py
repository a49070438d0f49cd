"""The Optuna study of a sweep: made (or loaded from `hydra.sweeper.storage`, any SQLAlchemy URL) with its
sampler and pruner; the trials a killed sweep left running marked failed and asked again; the best point
written to `<sweep dir>/optimization_results.yaml`."""

from __future__ import annotations

import os
import socket
from typing import Any

import yaml

from trainer.errors import ConfigError
from trainer.sweep.settings import Settings
from trainer.sweep.space import Space
from trainjob.files import write_whole


def _sampler(s: Settings, space: Space, seed: int | None) -> Any:
    import optuna

    if s.sampler == "grid":

        class Grid(optuna.samplers.GridSampler):
            def after_trial(self, *args: Any) -> None:
                """Nothing: the grid's own end (`study.stop()`) is for `optimize()`; a sweep ends at n_trials."""

        return Grid(space.grid(), seed=seed)
    if s.sampler == "cmaes":
        try:
            import cmaes  # noqa: F401  (what Optuna's CMA-ES sampler runs on)
        except ImportError:
            raise ConfigError("hydra.sweeper.sampler", "cmaes", "needs the cmaes package: pip install cmaes") from None
        return optuna.samplers.CmaEsSampler(seed=seed)
    sampler = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}[s.sampler]
    return sampler(seed=seed)


def _pruner(s: Settings) -> Any:
    import optuna

    if s.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=s.pruner_startup_trials, n_warmup_steps=s.pruner_warmup_steps
        )
    if s.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner()
    if s.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


def _storage(url: str | None) -> Any:
    """The study's storage: memory (None), or the database at `url`, opened now so that a URL that cannot be
    read is refused before any trial."""
    if url is None:
        return None
    import optuna

    try:
        return optuna.storages.RDBStorage(url)
    except Exception as e:  # SQLAlchemy and Optuna raise many kinds: one line with the cause
        lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        raise ConfigError("hydra.sweeper.storage", url, f"cannot open the study's database: {lines[0]}") from None


def open_study(s: Settings, space: Space) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler, pruner, storage = _sampler(s, space, s.seed), _pruner(s), _storage(s.storage)
    try:
        study = optuna.create_study(
            storage=storage,
            sampler=sampler,
            pruner=pruner,
            study_name=s.study_name,
            directions=list(s.directions),
            load_if_exists=True,
        )
    except ValueError as e:
        raise ConfigError("hydra.sweeper.storage", s.storage, f"study {s.study_name}: {e}") from None
    if list(study.directions) != [optuna.study.StudyDirection[d.upper()] for d in s.directions]:
        held = ", ".join(d.name.lower() for d in study.directions)
        raise ConfigError(
            "hydra.sweeper.direction",
            list(s.directions),
            f"study {s.study_name} in {s.storage} optimises {held}; give the same, or another study_name",
        )
    if s.seed is not None and (done := len(study.get_trials(deepcopy=False))):
        # A continued study's sampler, seeded as the first command's was, would draw that command's points again
        # (TPE's first trials are random draws): seeded by how far the study got, it goes on, still reproducibly.
        study.sampler = _sampler(s, space, s.seed + done)
    return study


def _alive(owner: str) -> bool:
    """Whether the sweep process `host:pid` that ran a trial still runs (a sweep on another host: assumed so)."""
    host, _, pid = owner.rpartition(":")
    if not host or not pid.isdigit():
        return False
    return host != socket.gethostname() or os.path.exists(f"/proc/{pid}")


def requeue_abandoned(study: Any) -> list[int]:
    """Trials a killed sweep left running: each marked failed, and its point asked again first."""
    from optuna.trial import TrialState

    abandoned = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not _alive(str(t.user_attrs.get("sweeper", "")))
    ]
    for t in abandoned:
        study.tell(t.number, state=TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"asked_again_for": t.number})
        print(f"trial {t.number}: was running when its sweep ended; marked failed, its point asked again", flush=True)
    return [t.number for t in abandoned]


def write_results(study: Any, s: Settings, sweep_dir: str) -> None:
    """optimization_results.yaml: the best point and value (several objectives: every Pareto-optimal trial)."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return
    if s.multi_objective:
        result = {"name": "optuna", "solutions": [{"params": t.params, "values": t.values} for t in study.best_trials]}
    else:
        result = {"name": "optuna", "best_params": study.best_params, "best_value": study.best_value}
    write_whole(os.path.join(sweep_dir, "optimization_results.yaml"), yaml.safe_dump(result, sort_keys=False))
