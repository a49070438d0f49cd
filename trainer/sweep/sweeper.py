"""`hydra/sweeper=optuna`: a Hydra sweeper on Optuna's ask-and-tell API. Each trial is a run of its own
(`python -m trainer ...`, trainer/sweep/trials.py), up to `n_jobs` at once; the sweeper reads each one's
metric as the run logs it, reports it to the study, and stops a trial the pruner gives up on. A study in
`storage` goes on where it stopped when the same command runs again.

Hydra 1.3 instantiates a sweeper only from a class registered under the `hydra_plugins` namespace and found
there by its name: `register()`, which the driver calls, gives this module that name too
(`hydra_plugins.trainjob`, as conf/hydra/sweeper/optuna.yaml names the class) and registers the class."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from launchers.options import offers
from trainer.errors import ConfigError
from trainer.sweep import settings as sweep_settings
from trainer.sweep.space import Space, as_override, parse
from trainer.sweep.study import open_study, requeue_abandoned, write_results
from trainer.sweep.trials import TrialProcess, cpu_shares, wait_any
from trainjob.run_files import RunDir

log = logging.getLogger("trainer.sweep")
POLL_S = 0.5
PLUGIN_MODULE = "hydra_plugins.trainjob"


def register() -> None:
    import importlib.util
    import types

    from hydra.core.plugins import Plugins

    if "hydra_plugins" not in sys.modules and importlib.util.find_spec("hydra_plugins") is None:
        namespace = types.ModuleType("hydra_plugins")  # no plugin installed: the namespace, empty
        namespace.__path__ = []
        sys.modules["hydra_plugins"] = namespace
    sys.modules[PLUGIN_MODULE] = sys.modules[__name__]
    Plugins.instance().register(OptunaSweeper)


def _refuse(e: Exception) -> None:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2)


class OptunaSweeper(Sweeper):
    __module__ = PLUGIN_MODULE

    def __init__(self, params: Any = None, **options: Any):
        self.params = OmegaConf.to_container(params) if isinstance(params, DictConfig) else dict(params or {})
        self.options = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in options.items()}
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        """Check the settings, the launcher and the storage: a bad one is one line and exit 2, before any trial."""
        self.config = config
        try:
            self.settings = sweep_settings.settings(**self.options)
            sweep_settings.check_launcher(config.launcher)
        except (ConfigError, TypeError) as e:
            _refuse(e)

    def sweep(self, arguments: list[str]) -> list[dict]:
        s = self.settings
        try:
            space = parse(self.params, arguments)
            study = open_study(s, space)
        except ConfigError as e:
            _refuse(e)
        sweep_dir = os.path.abspath(self.config.hydra.sweep.dir)
        os.makedirs(sweep_dir, exist_ok=True)
        requeue_abandoned(study)
        return _Run(study, s, space, sweep_dir, self.config.launcher, self._trial_overrides()).go()

    def _trial_overrides(self) -> list[str]:
        """The command's Hydra overrides each trial gets too (not the sweep's own)."""
        hydra_overrides = OmegaConf.to_container(self.config.hydra.overrides.hydra)
        return [
            o
            for o in hydra_overrides
            if not o.lstrip("+~").startswith(("hydra.sweep", "hydra/sweeper", "hydra.run", "hydra.mode"))
        ]


class _Run:
    """The ask-run-tell loop of one sweep."""

    def __init__(self, study, s, space: Space, sweep_dir: str, launcher: Any, hydra_overrides: list[str]):
        self.study, self.s, self.space, self.sweep_dir, self.launcher = study, s, space, sweep_dir, launcher
        self.hydra_overrides = hydra_overrides
        self.free = cpu_shares(s.n_jobs) if offers(launcher).cpus_here else [None] * s.n_jobs
        self.running: dict[int, tuple[Any, TrialProcess, Any]] = {}
        self.failed: tuple[int, str] | None = None  # the exit code the sweep ends with, and why
        self.results: list[dict] = []

    def _left(self) -> int:
        from optuna.trial import TrialState

        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        return self.s.n_trials - len(done) - len(self.running)

    def go(self) -> list[dict]:
        left = self._left()
        print(
            f"study {self.study.study_name}: {self.s.n_trials - left} of {self.s.n_trials} trials done; "
            f"running {max(left, 0)} ({self.s.n_jobs} at once) in {self.sweep_dir}",
            flush=True,
        )
        try:
            while True:
                while self.failed is None and self.free and self._left() > 0:
                    self._start()
                if not self.running:
                    break
                wait_any([t for _, t, _ in self.running.values()], POLL_S)
                for number in list(self.running):
                    self._watch(number)
        except BaseException:
            for _, trial, _ in self.running.values():  # Ctrl-C, a kill: no trial outlives the sweep
                trial.kill()
            raise
        if len(self.study.trials) and self.failed is None:
            write_results(self.study, self.s, self.sweep_dir)
        if self.failed is not None:
            print(f"error: {self.failed[1]}", file=sys.stderr)
            raise SystemExit(self.failed[0])
        return self.results

    def _start(self) -> None:
        trial = self.study.ask(self.space.distributions)
        trial.set_user_attr("sweeper", f"{socket.gethostname()}:{os.getpid()}")
        params = [as_override(k, v) for k, v in trial.params.items()]
        overrides = [*self.space.fixed, *params, *self.hydra_overrides]
        trial.set_user_attr("overrides", overrides)
        if (earlier := self._same_point(overrides)) is not None:
            self._repeat(trial, earlier, params)
            return
        share = self.free.pop(0)
        process = TrialProcess(trial.number, overrides, self.sweep_dir, self.launcher, share)
        trial.set_user_attr("run_dir", process.metrics_dir)
        process.start()
        print(f"trial {trial.number}: {' '.join(params) or '(no parameters)'}", flush=True)
        self.running[trial.number] = (trial, process, share)

    def _same_point(self, overrides: list[str]) -> Any:
        """An earlier trial of this study that ran the very same overrides to its end or was pruned, or None.
        A sampler over a discrete space (`choice`, `range`) asks for a point again; a run is deterministic for its
        config (its seed among it), so training it again would only spend the steps once more."""
        from optuna.trial import TrialState

        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if t.user_attrs.get("overrides") == overrides:
                return t
        return None

    def _repeat(self, trial: Any, earlier: Any, params: list[str]) -> None:
        """Tell the study what trial `earlier`, at the same point, gave: its values, or its intermediate values
        and pruned. No run is started; the trial's run directory is the earlier one's."""
        from optuna.trial import TrialState

        trial.set_user_attr("run_dir", earlier.user_attrs.get("run_dir"))
        trial.set_user_attr("repeat_of", earlier.number)
        print(f"trial {trial.number}: {' '.join(params) or '(no parameters)'}", flush=True)
        if earlier.state == TrialState.COMPLETE:
            values = earlier.values
            line = ", ".join(f"{m} {v:.4f}" for m, v in zip(self.s.metrics, values, strict=True))
        else:
            for step, value in sorted(earlier.intermediate_values.items()):
                trial.report(value, step)
            values, line = None, f"pruned at step {max(earlier.intermediate_values, default=0)}"
        self._record(trial, earlier.state, f"the point of trial {earlier.number}, not trained again: {line}", values,
                     earlier.user_attrs.get("run_dir"), repeat_of=earlier.number)

    def _watch(self, number: int) -> None:
        """Report the trial's new values; prune it, or tell the study how it ended."""
        from optuna.trial import TrialState

        trial, process, _ = self.running[number]
        if not self.s.multi_objective and self.s.pruner != "none":
            values = process.new_values(self.s.metrics[0])
            for step, value in values:
                trial.report(value, step)
            # At the newest step (where the run is now), and not at its last: a run that has trained to the end
            # ends complete.
            if values and values[-1][0] != process.max_steps() and trial.should_prune():
                step, value = values[-1]
                process.prune(step, self.s.metrics[0], value)
                self._end(number, TrialState.PRUNED, f"pruned at step {step} ({self.s.metrics[0]} {value:.4f})")
                return
        code = process.poll()
        if code is None:
            return
        if code != 0:
            self.failed = self.failed or (
                2 if code == 2 else 1,
                f"trial {number} ({process.run_dir}): {process.error_line()}",
            )
            self._end(number, TrialState.FAIL, f"failed with exit code {code}: {process.error_line()}")
            return
        values = [process.final(m) for m in self.s.metrics]
        if any(v is None for v in values):  # the recipe logs no such metric: every trial would end so
            line = f"no {', '.join(self.s.metrics)} in {RunDir.of(process.metrics_dir).metrics}"
            self.failed = self.failed or (1, f"trial {number}: {line} (hydra.sweeper.metric)")
            self._end(number, TrialState.FAIL, line)
            return
        self._end(
            number,
            TrialState.COMPLETE,
            ", ".join(f"{m} {v:.4f}" for m, v in zip(self.s.metrics, values, strict=True))
            + f" after {process.steps()} steps",
            values,
        )

    def _end(self, number: int, state, line: str, values: list[float] | None = None) -> None:
        trial, process, share = self.running.pop(number)
        self.free.append(share)
        self._record(trial, state, line, values, process.metrics_dir)

    def _record(self, trial: Any, state, line: str, values: list[float] | None, run_dir: str | None, **extra) -> None:
        """Tell the study how `trial` ended, add it to the sweep's results and print its line."""
        self.study.tell(trial, values if state.name == "COMPLETE" else None, state=state)
        self.results.append(
            {"trial": trial.number, "state": state.name.lower(), "values": values, "run_dir": run_dir, **extra}
        )
        print(f"trial {trial.number}: {line}", flush=True)
