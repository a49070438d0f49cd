"""Trackers and the loss picture: one tiny run with TensorBoard, MLflow and W&B (offline), resumed from an
earlier checkpoint with another seed, read back with each tool's own reader; loss.png drawn from the run's
numbers; trackers refused before anything starts."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import TINY, examples, read_metrics, read_summary
from trainer.config.tracker import TRACKER_MODULES
from trainer.config.validate import validate
from trainer.errors import ConfigError
from trainer.observability import plots, trackers

pytestmark = pytest.mark.slow  # each module trains (tiny runs) in subprocesses
ARGS = [
    *TINY,
    "train.max_steps=6",
    "train.eval_every=3",
    "train.checkpoint_every=3",
    "tracker.report_to=[jsonl,tensorboard,mlflow,wandb]",
]


def _train(cache_dir: str, cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, cache_dir):
    """A 6-step run in process, then the same run directory resumed from step 3 under torchrun with 2 ranks
    (only rank 0 may write) and another seed (other batches, so steps 4-6 get other losses): (run directory,
    the first attempt's lines, the first attempt's state)."""
    tmp = tmp_path_factory.mktemp("tracked")
    run_dir = tmp / "run"
    first = _train(cache_dir, tmp, *ARGS, f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    before = read_metrics(str(run_dir))
    state = json.loads((run_dir / "tracking.json").read_text())
    resume = [f"train.resume={run_dir}/checkpoints/step-3", "+runtime=torch-distributed", "runtime.nproc_per_node=2"]
    again = _train(cache_dir, tmp, *ARGS, "train.seed=1", *resume, f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    return str(run_dir), before, state


def _mlflow(state: dict):
    os.environ.setdefault(trackers.FILE_STORE_ENV, "true")  # MLflow 3 keeps the file store behind this opt-in
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=state["mlflow"]["tracking_uri"])


@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_tensorboard_events_hold_every_logged_scalar_and_the_config(resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = resumed
    events = EventAccumulator(os.path.join(run_dir, "tb"))
    events.Reload()
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "tokens", "trained_tokens", "step_time_s",
                "peak_memory_gb"):
        logged = [(r["step"], r[key]) for r in records if key in r]
        read = [(e.step, e.value) for e in events.Scalars(trackers.TB_TAGS[key])]
        assert [s for s, _ in read] == [s for s, _ in logged], key
        assert [v for _, v in read] == pytest.approx([v for _, v in logged], rel=1e-6), key
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "dim: 64" in text and "global_batch_size: 8" in text


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_the_same_curves_without_the_discarded_steps(resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, before, state = resumed
    after = read_metrics(run_dir)
    assert [r["loss"] for r in after[:3]] == [r["loss"] for r in before[:3]]
    assert all(a["loss"] != b["loss"] for a, b in zip(after[3:], before[3:], strict=True))  # the new seed's batches
    assert read_summary(run_dir)["world_size"] == 2
    assert len(glob.glob(os.path.join(run_dir, "tb", "events.out.tfevents.*"))) == 2  # one file per attempt
    events = EventAccumulator(os.path.join(run_dir, "tb"))
    events.Reload()
    read = [(e.step, e.value) for e in events.Scalars("loss/train")]
    assert [s for s, _ in read] == [1, 2, 3, 4, 5, 6]  # steps 4-6 of the first attempt were purged
    assert [v for _, v in read] == pytest.approx([r["loss"] for r in after], rel=1e-6)
    # MLflow and W&B go on in the same run.
    assert json.loads(pathlib.Path(run_dir, "tracking.json").read_text()) == state
    client = _mlflow(state)
    assert len(client.search_runs([client.get_experiment_by_name("trainjob").experiment_id])) == 1
    wandb_runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", f"run-{state['wandb']['run_id']}.wandb"))
    assert len(wandb_runs) == 2


@pytest.mark.timeout(300)
def test_the_mlflow_file_store_holds_the_config_as_params_and_the_metrics(resumed):
    import mlflow

    run_dir, _, state = resumed
    assert state["mlflow"]["tracking_uri"] == pathlib.Path(run_dir, "mlruns").resolve().as_uri()
    _mlflow(state)
    mlflow.set_tracking_uri(state["mlflow"]["tracking_uri"])
    run = mlflow.get_run(state["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "/".join(run_dir.split(os.sep)[-2:])
    params = run.data.params
    assert params["model.dim"] == "64" and params["train.global_batch_size"] == "8"
    assert json.loads(params["tracker.report_to"]) == ["jsonl", "tensorboard", "mlflow", "wandb"]
    records, summary = read_metrics(run_dir), read_summary(run_dir)
    assert run.data.metrics["loss"] == pytest.approx(summary["final_train_loss"])
    assert run.data.metrics["eval_loss"] == pytest.approx(summary["final_eval_loss"])
    history = _mlflow(state).get_metric_history(run.info.run_id, "eval_loss")
    # MLflow cannot delete points: the first attempt's step 6 stays beside the resumed one's.
    assert sorted(m.step for m in history) == [3, 6, 6]
    newest = max((m for m in history if m.step == 6), key=lambda m: m.timestamp)
    assert newest.value == pytest.approx(records[-1]["eval_loss"])


@pytest.mark.timeout(300)
def test_wandb_logs_offline_into_the_run_directory(resumed):
    run_dir, _, state = resumed
    (path,) = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb")))[:1]
    data = pathlib.Path(path).read_bytes()  # W&B ships no reader for offline files: its records hold the keys
    assert b"eval_loss" in data and b"tokens_per_s" in data and b"model.dim" in data
    assert path.endswith(f"run-{state['wandb']['run_id']}.wandb")


@pytest.mark.timeout(300)
def test_loss_png_is_drawn_from_the_runs_own_numbers(resumed):
    import matplotlib.image

    run_dir, _, _ = resumed
    png = os.path.join(run_dir, "loss.png")
    pixels = matplotlib.image.imread(png)
    assert os.path.getsize(png) > 20_000 and pixels.shape[0] > 400 and pixels.std() > 0.05
    records = read_metrics(run_dir)
    fig = plots.loss_figure(records, plots.tokens_per_step(run_dir))
    ax = fig.axes[0]
    train, evals = ax.lines
    assert list(train.get_xdata()) == [r["step"] for r in records]
    assert list(train.get_ydata()) == [r["loss"] for r in records]
    assert list(evals.get_xdata()) == [3, 6] and list(evals.get_ydata()) == [
        records[2]["eval_loss"],
        records[5]["eval_loss"],
    ]
    assert ax.get_xlabel() == "step" and ax.get_ylabel().startswith("loss")
    (tokens,) = ax.child_axes
    assert tokens.get_xlabel() == "tokens" and all(r["tokens"] == 8 * 32 for r in records)  # no padding
    low, high = ax.get_xlim()
    assert tokens.get_xlim() == pytest.approx([max(low, 0) * 8 * 32, high * 8 * 32])


def test_the_tokens_axis_counts_the_real_tokens_of_each_line_not_batch_times_length():
    """Rows of different lengths: the tokens trained on by a step are the sum of its lines' real tokens, padding
    left out; a run whose lines predate the counts falls back to the config's positions per step."""
    records = [{"step": 2, "loss": 3.0, "tokens": 100}, {"step": 4, "loss": 2.5, "tokens": 300},
               {"step": 6, "loss": 2.0, "tokens": 200}]
    forward, inverse = plots._tokens_seen(records, tokens_per_step=999)
    assert [float(forward(s)) for s in (0, 1, 2, 4, 5, 6)] == [0, 50, 100, 400, 500, 600]
    assert float(forward(8)) == pytest.approx(800)  # on at the run's mean rate past the last line
    assert [float(inverse(t)) for t in (100, 400, 600)] == [2, 4, 6]
    old_forward, _ = plots._tokens_seen([{"step": 1, "loss": 3.0}], tokens_per_step=256)
    assert old_forward(3) == 768
    assert plots._tokens_seen([{"step": 1, "loss": 3.0}], tokens_per_step=None) is None


@pytest.mark.timeout(120)
@settings(max_examples=examples(15))
@given(losses=st.lists(st.floats(0.01, 20.0), min_size=1, max_size=40), eval_every=st.integers(1, 7))
def test_the_loss_axis_is_log_scaled_when_the_losses_span_more_than_a_factor_of_two(losses, eval_every):
    records = [
        {"step": i + 1, "loss": v, **({"eval_loss": v * 1.1} if (i + 1) % eval_every == 0 else {})}
        for i, v in enumerate(losses)
    ]
    ax = plots.loss_figure(records).axes[0]
    values = losses + [r["eval_loss"] for r in records if "eval_loss" in r]
    assert ax.get_yscale() == ("log" if max(values) / min(values) > plots.LOG_SCALE_SPAN else "linear")
    assert list(ax.lines[0].get_ydata()) == losses
    assert list(ax.lines[1].get_xdata()) == [r["step"] for r in records if "eval_loss" in r]


def _compose(*overrides: str):
    from trainer.config.compose import compose

    cfg = compose(overrides)
    cfg.run_dir = "/tmp/unused"
    return cfg


@pytest.mark.timeout(60)
def test_an_unknown_tracker_is_refused_before_anything_starts(run_cli, tmp_path):
    proc = run_cli(*TINY, "tracker.report_to=[jsonl,neptune]", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: invalid config: tracker.report_to=['jsonl', 'neptune']: unknown tracker 'neptune': trackers are "
        "jsonl, tensorboard, mlflow, wandb"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow", "wandb"])
def test_a_tracker_whose_package_is_missing_is_refused_naming_the_extra(tracker, monkeypatch):

    cfg = _compose(f"tracker.report_to=[{tracker}]")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == TRACKER_MODULES[tracker] else real(name, *a),
    )
    with pytest.raises(
        ConfigError,
        match=rf"tracker {tracker} needs the {tracker} package, which is not "
        r"installed: pip install 'trainjob\[tracking\]'",
    ):
        validate(cfg)


@pytest.mark.timeout(60)
def test_a_wandb_mode_that_does_not_exist_is_refused():

    with pytest.raises(ConfigError, match=r"tracker.wandb.mode='cloud': must be one of online, offline, disabled"):
        validate(_compose("tracker.wandb.mode=cloud"))


def test_a_single_step_is_a_marked_point_on_whole_step_ticks():
    ax = plots.loss_figure([{"step": 1, "loss": 5.5, "eval_loss": 5.6}]).axes[0]
    train, evals = ax.lines
    assert train.get_marker() == "o" and evals.get_marker() == "o"
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks) and 1 in ticks


def test_a_long_run_is_a_line_with_thousands_on_the_step_axis():
    records = [{"step": s, "loss": 3.0 - s / 100_000} for s in range(1, 100_001, 10)]
    fig = plots.loss_figure(records)
    ax = fig.axes[0]
    assert ax.lines[0].get_marker() in (None, "None", "")
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert any(label.endswith("k") for label in labels) and all(len(label) <= 5 for label in labels), labels


@pytest.mark.parametrize(("recipe", "metric", "loss_label", "below"), [
    ("dpo", "rewards/margins", "DPO loss (nats/pair)", "reward margin (nats, chosen - rejected)"),
    ("grpo", "reward", "GRPO loss (clipped surrogate)", "mean reward per completion"),
])
def test_a_recipe_with_a_quantity_of_its_own_draws_it_under_its_loss(recipe, metric, loss_label, below):
    records = [{"step": s, "loss": 0.69 - s / 100, metric: s / 10} for s in range(1, 11)]
    fig = plots.loss_figure(records, recipe=recipe)
    top, under = fig.axes
    assert top.get_ylabel() == loss_label and under.get_ylabel() == below
    assert list(under.lines[0].get_ydata()) == [s / 10 for s in range(1, 11)]
    assert plots.loss_figure(records).axes[0].get_ylabel() == "loss (nats/token)" and len(plots.loss_figure(
        records).axes) == 1
