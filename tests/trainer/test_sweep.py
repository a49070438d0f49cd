"""hydra/sweeper=optuna (trainer/sweep/): a 4-trial study of tiny runs, two at once on their own CPUs, with the
median pruner stopping the trials that lag; the study in SQLite goes on when the command runs again, and a
trial its killed sweep left running is asked again; bad settings are refused in one line before any trial."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest
import yaml

from tests.conftest import TINY, cli
from trainer.observability import report
from trainjob.run_files import read_events, read_metrics, read_summary

pytestmark = pytest.mark.slow  # each trial trains (tiny runs) in a process of its own

EVERY = 20
SWEEP = [
    *TINY,
    "train.max_steps=150",
    f"train.eval_every={EVERY}",
    "train.eval_batches=1",
    "train.log_every=5",
    "train.checkpoint_every=1000",
    "hydra/sweeper=optuna",
    "hydra.sweeper.n_jobs=2",
    "hydra.sweeper.pruner=median",
    "hydra.sweeper.pruner_startup_trials=2",
    "hydra.sweeper.seed=1",
    "optim.lr=tag(log, interval(1e-7, 1e-2))",
]


def _trial_cpus(sweep: str, seen: dict[str, set[str]], most: list[int], done: threading.Event) -> None:
    """While the sweep runs: the CPUs each trial's driver may use, and the most trials running at once."""
    while not done.is_set():
        running = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().decode(errors="replace").split("\0")
                with open(f"/proc/{pid}/status") as f:
                    cpus = next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))
            except (OSError, StopIteration):
                continue
            run_dir = next((a.split("=", 1)[1] for a in args if a.startswith(f"hydra.run.dir={sweep}/")), None)
            if run_dir and args[1:3] == ["-m", "trainer"]:
                running.add(run_dir)
                seen.setdefault(run_dir, set()).add(cpus)
        most[0] = max(most[0], len(running))
        time.sleep(0.1)


@pytest.fixture(scope="module")
def study(tmp_path_factory, cache_dir):
    """(sweep directory, storage URL, the sweep's process, CPUs seen per trial, most trials at once)."""
    tmp = tmp_path_factory.mktemp("sweep")
    sweep, storage = str(tmp / "sweep"), f"sqlite:///{tmp / 'study.db'}"
    seen: dict[str, set[str]] = {}
    most, done = [0], threading.Event()
    watcher = threading.Thread(target=_trial_cpus, args=(sweep, seen, most, done), daemon=True)
    watcher.start()
    proc = cli(
        cache_dir,
        tmp,
        "-m",
        *SWEEP,
        "hydra.sweeper.n_trials=4",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweep.dir={sweep}",
        timeout=400,
    )
    done.set()
    watcher.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep, storage, proc, seen, most[0]


def _trials(storage: str) -> list:
    return optuna.load_study(study_name="trainjob", storage=storage).trials


@pytest.mark.timeout(600)
@pytest.mark.e2e
def test_two_trials_run_at_once_each_on_its_own_cpus(study):
    sweep, _, _, seen, most = study
    assert most == 2
    assert sorted(seen) == [os.path.join(sweep, str(n)) for n in range(4)]
    shares = [cpus for trial in seen.values() for cpus in trial]
    assert all(len(trial) == 1 for trial in seen.values())  # one share each, for its whole run
    if len(os.sched_getaffinity(0)) >= 2:
        first, second = (seen[os.path.join(sweep, str(n))].copy().pop() for n in (0, 1))
        assert first != second, shares  # trials 0 and 1 ran together: different CPUs


@pytest.mark.timeout(600)
def test_the_median_pruner_stops_lagging_trials_and_the_sweep_exits_0(study):
    sweep, storage, proc, _, _ = study
    trials = _trials(storage)
    states = [t.state.name for t in trials]
    assert states[:2] == ["COMPLETE", "COMPLETE"] and "PRUNED" in states[2:], states
    for t in trials:
        run_dir = os.path.join(sweep, str(t.number))
        steps = [r["step"] for r in read_metrics(run_dir)]
        if t.state.name == "COMPLETE":
            assert steps[-1] == 150 and t.value == read_summary(run_dir)["final_eval_loss"]
            continue
        (event,) = [e for e in read_events(run_dir) if e["event"] == "pruned"]
        assert event["at_step"] == t.last_step and event["at_step"] % EVERY == 0
        assert event["value"] == t.intermediate_values[t.last_step]
        # Stopped: no summary, no checkpoint, and no step logged more than two eval intervals after the decision.
        assert read_summary(run_dir) is None and not os.path.exists(os.path.join(run_dir, "checkpoints"))
        assert event["at_step"] <= steps[-1] <= event["at_step"] + 2 * EVERY < 150
        assert f"trial {t.number}: pruned at step {event['at_step']}" in proc.stdout
    # Every reported value is an eval loss of its run's metrics, at its step.
    for t in trials:
        records = read_metrics(os.path.join(sweep, str(t.number)))
        evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
        assert t.intermediate_values and all(evals[s] == v for s, v in t.intermediate_values.items())


@pytest.mark.timeout(600)
def test_the_report_shows_each_pruned_trial_and_its_step(study, tmp_path):
    sweep, storage, proc, _, _ = study
    rows, curves = report.collect([sweep])
    for t, row, (label, _) in zip(_trials(storage), rows, curves, strict=True):
        if t.state.name == "PRUNED":
            assert row.events == f"pruned at step {t.last_step}" and label.endswith(f"(pruned at step {t.last_step})")
            assert f"pruned at step {t.last_step}" in proc.stdout  # the sweep's own table
        else:
            assert row.events == "-" and "pruned" not in label
    assert os.path.getsize(os.path.join(sweep, "report.png")) > 20_000


@pytest.mark.timeout(600)
def test_the_same_command_goes_on_with_the_stored_study(study, cache_dir, tmp_path):
    sweep, storage, _, _, _ = study
    before = [(t.number, t.params, t.state.name) for t in _trials(storage)]
    again = cli(
        cache_dir,
        tmp_path,
        "-m",
        *SWEEP,
        "hydra.sweeper.n_trials=5",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweep.dir={sweep}",
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "study trainjob: 4 of 5 trials done; running 1" in again.stdout
    after = _trials(storage)
    assert [(t.number, t.params, t.state.name) for t in after[:4]] == before  # none rerun
    assert len(after) == 5 and after[4].state.name in ("COMPLETE", "PRUNED")
    assert sorted(p for p in os.listdir(sweep) if p.isdigit()) == ["0", "1", "2", "3", "4"]


@pytest.mark.timeout(600)
@pytest.mark.e2e
def test_a_trial_running_when_its_sweep_was_killed_is_failed_and_asked_again(cache_dir, tmp_path):
    storage, sweep = f"sqlite:///{tmp_path / 'killed.db'}", str(tmp_path / "sweep")
    args = [
        sys.executable,
        "-m",
        "trainer",
        "-m",
        *SWEEP,
        "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.pruner=none",
        "hydra.sweeper.n_trials=1",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweep.dir={sweep}",
    ]
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir}
    first = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not read_metrics(os.path.join(sweep, "0")) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    (killed,) = _trials(storage)
    assert killed.state.name == "RUNNING"
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trial 0: was running when its sweep ended; marked failed, its point asked again" in again.stdout
    failed, rerun = _trials(storage)
    assert (failed.state.name, rerun.state.name) == ("FAIL", "COMPLETE") and rerun.params == killed.params
    assert read_summary(os.path.join(sweep, "1"))["steps"] == 150


REFUSED = [  # (the bad settings, the start of the one line that refuses them)
    ("hydra.sweeper.metric=eval_los", "hydra.sweeper.metric='eval_los': eval_los is not a metric of metrics.jsonl"),
    (
        "hydra.sweeper.direction=[minimize,maximize] hydra.sweeper.metric=[eval_loss,tokens_per_s]",
        "hydra.sweeper.pruner='median': Optuna cannot prune a study of 2 objectives",
    ),
    ("hydra.sweeper.n_jobs=0", "hydra.sweeper.n_jobs=0: a whole number >= 1"),
    (
        "hydra.sweeper.storage=sqlite:////nonexistent/dir/study.db",
        "hydra.sweeper.storage='sqlite:////nonexistent/dir/study.db': cannot open the study's database: ",
    ),
    ("hydra.sweeper.sampler=grid", "hydra.sweeper.sampler='grid': optim.lr is an interval; a grid takes choice(...)"),
    ("launcher.wait=false", "launcher.wait=False: a sweep reads each trial's metrics as it runs"),
]


@pytest.mark.timeout(300)
def test_bad_sweep_settings_are_one_line_and_exit_2_before_any_trial(run_cli_batch, tmp_path):
    runs = [
        (["-m", *SWEEP, *bad.split(), f"hydra.sweep.dir={tmp_path / str(i)}"], str(tmp_path))
        for i, (bad, _) in enumerate(REFUSED)
    ]
    for i, ((bad, expected), proc) in enumerate(zip(REFUSED, run_cli_batch(runs), strict=True)):
        assert proc.returncode == 2, (bad, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: invalid config: {expected}"), (bad, lines)
        made = tmp_path / str(i)
        assert not made.exists() or not any(p.isdigit() for p in os.listdir(made)), bad  # no trial started


@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_several_objectives_give_the_pareto_front(run_cli, tmp_path):
    sweep = tmp_path / "pareto"
    proc = run_cli(
        "-m",
        *TINY,
        "train.max_steps=4",
        "train.eval_every=2",
        "train.eval_batches=1",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.seed=0",
        "hydra.sweeper.direction=[minimize,maximize]",
        "hydra.sweeper.metric=[eval_loss,tokens_per_s]",
        "optim.lr=tag(log, interval(1e-4, 1e-2))",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(sweep / "optimization_results.yaml") as f:
        solutions = yaml.safe_load(f)["solutions"]
    runs = {str(n): read_metrics(str(sweep / str(n))) for n in range(2)}
    points = {(r[-1]["eval_loss"], r[-1]["tokens_per_s"]) for r in runs.values()}
    assert solutions and all(tuple(s["values"]) in points for s in solutions)


@pytest.mark.timeout(300)
def test_a_trial_whose_config_is_refused_ends_the_sweep_with_exit_2(run_cli, tmp_path):
    sweep = tmp_path / "refused"
    proc = run_cli(
        "-m",
        *TINY,
        "train.max_steps=2",
        "hydra/sweeper=optuna",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.n_trials=2",
        "train.global_batch_size=choice(8,0)",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: trial ") and "train.global_batch_size=0" in line, line


@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_a_grid_runs_each_point_once(run_cli, tmp_path):
    sweep = tmp_path / "grid"
    proc = run_cli(
        "-m",
        *TINY,
        "train.max_steps=2",
        "hydra/sweeper=optuna",
        "hydra.sweeper.sampler=grid",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "optim.lr=choice(1e-3,1e-2)",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lrs = set()
    for n in range(2):
        with open(sweep / str(n) / "config.yaml") as f:
            lrs.add(yaml.safe_load(f)["optim"]["lr"])
    assert lrs == {1e-3, 1e-2}


@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_a_point_asked_again_is_not_trained_again(run_cli, tmp_path):
    sweep, db = tmp_path / "again", tmp_path / "again.db"
    proc = run_cli(
        "-m",
        *TINY,
        "train.max_steps=2",
        "train.eval_every=2",
        "train.eval_batches=1",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.seed=0",
        f"hydra.sweeper.storage=sqlite:///{db}",
        "optim.lr=choice(1e-3)",  # one point: TPE can only ask for it again
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(d for d in os.listdir(sweep) if d.isdigit()) == ["0"]  # one run trained
    final = read_summary(str(sweep / "0"))["final_eval_loss"]
    for n in (1, 2):
        assert f"trial {n}: the point of trial 0, not trained again: eval_loss {final:.4f}" in proc.stdout
    trials = optuna.load_study(study_name="trainjob", storage=f"sqlite:///{db}").trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert [t.value for t in trials] == [pytest.approx(final)] * 3
    assert [t.user_attrs.get("repeat_of") for t in trials] == [None, 0, 0]


def test_a_point_pruned_before_is_pruned_again_without_a_run(tmp_path, capsys):
    """The sweeper's loop on a real in-memory study: trial 0 was pruned at step 4; the sampler asks for its point
    again; the repeat is told pruned with trial 0's intermediate values and no process starts."""
    from trainer.config.compose import compose
    from trainer.sweep import settings as sweep_settings
    from trainer.sweep.space import parse
    from trainer.sweep.study import open_study
    from trainer.sweep.sweeper import _Run

    s = sweep_settings.settings(pruner="median", n_trials=2, seed=0)
    space = parse({}, ["optim.lr=choice(1e-3)"])
    study = open_study(s, space)
    run = _Run(study, s, space, str(tmp_path), compose([]).launcher, [])
    first = study.ask(space.distributions)
    first.set_user_attr("overrides", [*space.fixed, "optim.lr=0.001"])
    first.report(3.5, 2)
    first.report(3.25, 4)
    study.tell(first, state=optuna.trial.TrialState.PRUNED)
    run._start()
    assert not run.running and os.listdir(tmp_path) == []
    again = study.trials[1]
    assert again.state.name == "PRUNED" and again.intermediate_values == {2: 3.5, 4: 3.25}
    assert run.results == [{"trial": 1, "state": "pruned", "values": None, "run_dir": None, "repeat_of": 0}]
    assert "trial 1: the point of trial 0, not trained again: pruned at step 4" in capsys.readouterr().out
