"""Sweeps and their report: a 4-trial Optuna study on the debug model minimises the final eval loss, the sweep
ends with its table and report.png, and `python -m trainer.observability.report` agrees with the runs' summaries."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import TINY, examples, read_metrics, read_summary
from trainer.observability import plots, report

pytestmark = pytest.mark.slow  # each module trains (tiny runs) in subprocesses


@pytest.fixture(scope="module")
def study(tmp_path_factory, cache_dir):
    """`python -m trainer -m hydra/sweeper=optuna ...`: 4 trials of 4 steps, searching optim.lr and
    lr_schedule.warmup_steps as docs/tracking.md shows; (sweep directory, the sweep's stdout)."""
    tmp = tmp_path_factory.mktemp("optuna")
    sweep = tmp / "sweep"
    args = [
        *(o for o in TINY if not o.startswith("lr_schedule.warmup_steps=")),  # searched here
        "train.max_steps=4",
        "train.eval_every=4",
        "train.eval_batches=1",
        "train.checkpoint_every=100",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.seed=0",
        "optim.lr=tag(log,interval(1e-4,1e-2))",
        "lr_schedule.warmup_steps=range(0,4)",
        f"hydra.sweep.dir={sweep}",
    ]
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "-m", *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(sweep), proc.stdout


def _runs(sweep: str) -> list[str]:
    return [os.path.join(sweep, str(n)) for n in range(4)]


@pytest.mark.timeout(360)
@pytest.mark.e2e
def test_the_optuna_study_minimises_the_final_eval_loss(study):
    sweep, _ = study
    assert sorted(p for p in os.listdir(sweep) if p.isdigit()) == ["0", "1", "2", "3"]
    with open(os.path.join(sweep, "optimization_results.yaml")) as f:
        result = yaml.safe_load(f)
    losses = [read_summary(r)["final_eval_loss"] for r in _runs(sweep)]
    assert result["best_value"] == pytest.approx(min(losses))
    best = _runs(sweep)[losses.index(min(losses))]
    with open(os.path.join(best, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert result["best_params"] == {
        "optim.lr": pytest.approx(saved["optim"]["lr"]),
        "lr_schedule.warmup_steps": saved["lr_schedule"]["warmup_steps"],
    }
    assert len({read_summary(r)["final_eval_loss"] for r in _runs(sweep)}) == 4  # four different points


@pytest.mark.timeout(360)
def test_the_report_table_agrees_with_the_runs_summaries(study, tmp_path):
    from rich.console import Console

    sweep, stdout = study
    out = io.StringIO()
    rows, png = report.report([sweep], str(tmp_path / "r.png"), console=Console(file=out, width=200))
    assert png == str(tmp_path / "r.png") and os.path.getsize(png) > 20_000
    assert [r.run for r in rows] == ["0", "1", "2", "3"]
    for row, run_dir in zip(rows, _runs(sweep), strict=True):
        summary = read_summary(run_dir)
        with open(os.path.join(run_dir, "config.yaml")) as f:
            saved = yaml.safe_load(f)
        assert row.overrides == {"optim.lr": str(saved["optim"]["lr"]),
                                 "lr_schedule.warmup_steps": str(saved["lr_schedule"]["warmup_steps"])}
        assert (row.steps, row.final_train_loss, row.final_eval_loss) == (
            4,
            summary["final_train_loss"],
            summary["final_eval_loss"],
        )
        assert (row.tokens_per_s, row.time_s) == (summary["tokens_per_s"], summary["train_time_s"])
        assert row.peak_memory_gb == max(summary["peak_memory_gb_per_rank"])
        line = next(x for x in out.getvalue().splitlines() if x.startswith(f"│ {row.run} "))
        assert f"{row.final_eval_loss:.4f}" in line and f"{row.final_train_loss:.4f}" in line
        # The sweep printed the same table when it ended.
        assert f"{row.final_eval_loss:.4f}" in stdout
    assert "lr_schedule.warmup_steps" in out.getvalue() and "optim.lr" in out.getvalue()


@pytest.mark.timeout(360)
def test_the_sweep_writes_report_png_with_every_runs_curve(study):
    import matplotlib.image

    sweep, _ = study
    pixels = matplotlib.image.imread(os.path.join(sweep, "report.png"))
    assert pixels.shape[0] > 400 and pixels.std() > 0.05
    rows, curves = report.collect([sweep])
    ax = plots.report_figure(curves).axes[0]
    train_lines = ax.lines[::2]
    # Each run is named by the values that differ between the runs (its directory's name is not one of them).
    names = [line.get_label() for line in train_lines]
    assert names == [" ".join(f"{k}={report._short(v)}" for k, v in r.overrides.items()) for r in rows]
    assert len(set(names)) == 4 and all("=" in n and not n.startswith(("0", "1", "2", "3")) for n in names)
    for line, run_dir in zip(train_lines, _runs(sweep), strict=True):
        assert list(line.get_ydata()) == [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.timeout(120)
def test_report_cli_refuses_paths_that_are_not_runs(tmp_path, study):
    sweep, _ = study
    (tmp_path / "empty").mkdir()
    cli = [sys.executable, "-m", "trainer.observability.report"]
    missing = subprocess.run([*cli, str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: {tmp_path / 'nope'}: no such directory"
    empty = subprocess.run([*cli, str(tmp_path / "empty")], capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "not a run directory" in empty.stderr
    assert os.listdir(tmp_path / "empty") == []  # nothing written
    assert report.main([os.path.join(sweep, "0"), os.path.join(sweep, "2"), "-o", str(tmp_path / "two.png")]) == 0
    assert os.path.getsize(tmp_path / "two.png") > 20_000


values = st.sampled_from(["1", "2", "0.001", "true", "[1, 2]"])


@pytest.mark.timeout(60)
@settings(max_examples=examples(50))
@given(configs=st.lists(st.dictionaries(st.sampled_from(["a", "b.c", "d", "run_dir"]), values), min_size=1, max_size=5))
def test_the_table_shows_exactly_the_keys_whose_values_differ(configs):
    keys = report.differing(configs)
    everywhere = {k for c in configs for k in c}
    for key in everywhere - {"run_dir"}:
        same = all(key in c for c in configs) and len({c[key] for c in configs}) == 1
        assert (key in keys) == (not same)
    assert "run_dir" not in keys and len(keys) == len(set(keys))
