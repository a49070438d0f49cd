"""Before Hydra makes a directory: a run or sweep directory that is a file is refused, and a `-m` sweep with a
value that cannot run is refused, naming the job, before its first job runs (exit 2, one line, nothing
written); a local run asks for no more ranks than this machine has GPUs, and no more cache nodes than
training rows."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, compose_refused, compose_run
from trainer.prepare.callbacks import _check_directory

pytestmark = pytest.mark.timeout(240)


def _one_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_a_sweep_with_a_value_that_cannot_run_is_refused_before_its_first_job(run_cli, tmp_path):
    proc = run_cli("-m", *TINY, "train.max_steps=1", "optim.lr=1e-3,-1", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    line = _one_line(proc)
    assert line == "error: sweep job 1 (optim.lr=-1), before any job ran: invalid config: optim.lr=-1.0: must be > 0"
    assert not (tmp_path / "sweep").exists()
    assert "Launching" not in proc.stdout + proc.stderr

    # A sweep of one job too: no multirun.yaml left behind.
    proc = run_cli("-m", *TINY, "optim.lr=-1", f"hydra.sweep.dir={tmp_path / 'one'}")
    assert _one_line(proc) == "error: sweep job 0, before any job ran: invalid config: optim.lr=-1.0: must be > 0"
    assert not (tmp_path / "one").exists()


def test_a_run_directory_that_is_a_file_is_refused_and_the_file_kept(run_cli, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = run_cli(*TINY, "train.max_steps=1", "hydra.run.dir=notes.txt")
    assert _one_line(proc) == "error: hydra.run.dir=notes.txt: is a file; the run writes a directory there"
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(("path", "message"), [
    ("notes.txt/run", "is inside {tmp}/notes.txt, which is a file"),
    ("notes.txt/a/b", "is inside {tmp}/notes.txt, which is a file"),
    ("notes.txt", "is a file"),
])
def test_a_directory_inside_a_file_is_refused(tmp_path, capsys, monkeypatch, path, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        _check_directory("hydra.sweep.dir", path)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: hydra.sweep.dir={path}: {message.format(tmp=tmp_path)}; the run writes a directory there"
    )
    _check_directory("hydra.sweep.dir", str(tmp_path / "new" / "dir"))  # not there yet: fine


def test_more_ranks_than_this_machines_gpus_are_refused(tmp_path, capsys, monkeypatch):
    """This machine has no GPU: the count of local GPUs is patched (the one double here); with none, the
    ranks run on the CPU and any number is allowed."""
    monkeypatch.setattr("trainer.config.runtime.local_gpus", lambda: 1)
    err = compose_refused(tmp_path, capsys, *TINY, "+runtime=torch-distributed", "runtime.nproc_per_node=2")
    assert "runtime.nproc_per_node=2: must be <= 1, the GPUs on this machine (each rank takes one)" in err
    monkeypatch.setattr("trainer.config.runtime.local_gpus", lambda: 0)
    run = compose_run(tmp_path, *TINY, "+runtime=torch-distributed", "runtime.nproc_per_node=2")
    assert run.spec.nproc_per_node == 2


def test_more_cache_nodes_than_training_rows_are_refused(tmp_path, capsys):
    err = compose_refused(tmp_path, capsys, *TINY, "data.cache.nodes=100000000")
    assert "data.cache.nodes=100000000: each node serves a part of the train split's " in err
    assert "rows: must be <= " in err


def test_under_optuna_each_trial_is_checked_as_it_starts(run_cli, tmp_path):
    """Optuna picks each point from the trials before it, so no job is known in advance: the first trial
    that cannot run ends the sweep with its one line and exit 2."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    proc = run_cli("-m", *TINY, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1",
                   "optim.lr=choice(-1,-2)", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: invalid config: optim.lr=-") and last.endswith(": must be > 0"), proc.stderr


def test_the_default_run_checks_its_inputs_once_in_the_drivers_process(tmp_path, monkeypatch):
    """The default run calls the worker in the driver's process: the input checks the driver ran are handed
    over, not run again."""
    from trainer.prepare import inputs

    calls = []
    real = inputs.check
    monkeypatch.setattr(inputs, "check", lambda *args: calls.append(args) or real(*args))
    run = compose_run(tmp_path, *TINY, "train.max_steps=1", "train.eval_every=1", "train.progress=false")
    assert len(calls) == 1 and run.checked is not None and run.checked.corpus is not None
    summary = run.launcher_for().launch(run.spec).result()
    assert summary["steps"] == 1 and len(calls) == 1
