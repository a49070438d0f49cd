"""Resume picks the right checkpoint: resuming from an earlier step starts a new line and sets the old
line's later checkpoints aside (never resumed by resume=auto, never pruned in place of the new ones), and a
metrics.jsonl whose last line was cut short does not stop the run, and a run resumed with another optim.lr
trains with it.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import TINY, read_metrics, read_summary
from trainer.checkpoint import lines, resume
from trainer.config.lr_schedule import LRScheduleConfig
from trainer.training.optimizer import lr_factor

pytestmark = pytest.mark.slow


@pytest.mark.e2e
def test_resuming_from_an_earlier_step_sets_the_later_checkpoints_aside(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    first = run_cli(*TINY, "train.max_steps=8", "train.checkpoint_every=4", "train.keep_latest_k=2",
                    f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(os.listdir(ckpts)) == ["step-4", "step-8"]
    old_line = read_metrics(str(run_dir))

    # From step 4, with another data order, on two ranks: rank 0 chooses and sets aside, both load.
    branch = run_cli(*TINY, f"train.resume={ckpts / 'step-4'}", "train.max_steps=6", "train.checkpoint_every=2",
                     "train.keep_latest_k=1", "train.seed=1", "+runtime=torch-distributed",
                     "runtime.nproc_per_node=2", f"hydra.run.dir={run_dir}")
    assert branch.returncode == 0, branch.stderr[-3000:]
    aside = [name for name in os.listdir(ckpts) if name.startswith("abandoned-")]
    # (.branch records where this line began, for restarts)
    assert len(aside) == 1 and sorted(os.listdir(ckpts)) == sorted([".branch", aside[0], "step-6"])
    assert os.listdir(ckpts / aside[0]) == ["step-8"]
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"step-8, of the line it leaves, moved to {ckpts / aside[0]}" in log
    for rank in (0, 1):
        assert f"resumed from {ckpts / 'step-4'} (step 4)" in (run_dir / "logs" / f"rank-{rank}.log").read_text()
    new_line = read_metrics(str(run_dir))
    assert [m["step"] for m in new_line] == [1, 2, 3, 4, 5, 6]
    assert new_line[:4] == old_line[:4] and new_line[4]["loss"] != pytest.approx(old_line[4]["loss"], rel=1e-6)

    # resume=auto continues the new line, not the abandoned step-8.
    auto = run_cli(*TINY, "train.max_steps=8", "train.checkpoint_every=2", "train.keep_latest_k=1",
                   "train.seed=1", f"hydra.run.dir={run_dir}")
    assert auto.returncode == 0, auto.stderr[-3000:]
    summary = read_summary(str(run_dir))
    assert summary["resumed_from"] == str(ckpts / "step-6") and summary["steps_this_run"] == 2
    assert [m["step"] for m in read_metrics(str(run_dir))] == list(range(1, 9))
    assert os.listdir(ckpts / aside[0]) == ["step-8"]


@pytest.mark.e2e
def test_a_metrics_line_cut_short_is_dropped_and_the_run_goes_on(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(*TINY, "train.max_steps=2", "train.checkpoint_every=2", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 5.1')  # a kill, or a full disk, mid-write
    # Resumed with another learning rate: the config's, not the checkpoint's, on the schedule at step 2.
    again = run_cli(*TINY, "train.max_steps=4", "train.checkpoint_every=2", "optim.lr=0.01",
                    f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    metrics = read_metrics(str(run_dir))
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[1]["lr"] == pytest.approx(3e-3 * lr_factor(2, 2, 2, LRScheduleConfig.min_lr_factor))
    assert [m["lr"] for m in metrics[2:]] == pytest.approx(
        [0.01 * lr_factor(step, 2, 4, LRScheduleConfig.min_lr_factor) for step in (3, 4)]
    )
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "dropped 1 unreadable line(s)" in log
    assert f"optim.lr: the checkpoint {run_dir / 'checkpoints' / 'step-2'} was trained with 0.003; this run goes on " \
           "with 0.01" in log


@pytest.mark.e2e
def test_a_restart_after_an_explicit_resume_continues_the_new_line(run_cli, tmp_path):
    """The saved config keeps train.resume=<step-4>: a restart of the same config (torchrun's, a pod's, the
    worker run again) goes on from the new line's newest checkpoint, sets nothing aside, and still does so
    once step-4 itself was pruned."""
    run_dir = tmp_path / "run"
    common = [*TINY, "train.eval_every=100", f"hydra.run.dir={run_dir}"]
    first = run_cli(*common, "train.max_steps=8", "train.checkpoint_every=4", "train.keep_latest_k=5")
    assert first.returncode == 0, first.stderr[-2000:]
    branch = run_cli(*common, "train.max_steps=12", "train.checkpoint_every=2", "train.keep_latest_k=2",
                     f"train.resume={run_dir / 'checkpoints' / 'step-4'}")
    assert branch.returncode == 0, branch.stderr[-2000:]
    ckpts = run_dir / "checkpoints"
    assert sorted(p for p in os.listdir(ckpts) if p.startswith("step-")) == ["step-10", "step-12"]  # 4 pruned
    asides = sorted(p for p in os.listdir(ckpts) if p.startswith("abandoned-"))
    assert len(asides) == 1 and os.listdir(ckpts / asides[0]) == ["step-8"]

    summary = (run_dir / "summary.json").read_text()
    again = run_cli(str(run_dir / "config.yaml"), module="trainer.worker")
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p for p in os.listdir(ckpts) if p.startswith("abandoned-")) == asides  # nothing new set aside
    assert f"resumed from {ckpts / 'step-12'} (step 12)" in (run_dir / "logs" / "rank-0.log").read_text()
    # Already at its last step: the run's summary stays as the branch wrote it, not one of a run of no steps.
    assert (run_dir / "summary.json").read_text() == summary
    assert read_summary(str(run_dir))["steps_this_run"] == 8


@pytest.mark.e2e
def test_resuming_with_another_global_batch_is_refused_in_one_line(run_cli, tmp_path):
    """The data position is step x global batch: another batch size would repeat or skip rows."""
    run_dir = tmp_path / "run"
    first = run_cli(*TINY, "train.max_steps=2", "train.eval_every=100", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(*TINY, "train.max_steps=4", "train.eval_every=100", "train.global_batch_size=16",
                    f"hydra.run.dir={run_dir}")
    assert again.returncode == 2, again.stderr[-2000:]
    lines = again.stderr.strip().splitlines()
    assert lines[-1] == (f"error: invalid config: train.global_batch_size=16: the checkpoint "
                         f"{run_dir / 'checkpoints' / 'step-2'} was trained with a global batch of 8; resuming "
                         "with another would repeat or skip rows: keep train.global_batch_size=8")
    assert "Traceback" not in again.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the checkpoints are written in this process
def test_the_start_is_decided_by_one_rule_auto_never_a_path_or_the_newest_of_the_line_it_began(tmp_path):
    """`resume.decide` alone says where a run starts (the driver's preflight and rank 0 call it, nothing else)."""
    own = tmp_path / "run" / "checkpoints"
    elsewhere = tmp_path / "other" / "checkpoints" / "step-9"
    for path in (own / "step-2", own / "step-4", elsewhere):
        dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(path), no_dist=True)
    cfg = SimpleNamespace(run_dir=str(tmp_path / "run"), train=SimpleNamespace(resume="auto"))
    assert resume.decide(cfg) == resume.Start(str(own / "step-4"), branches=False)
    cfg.train.resume = "never"
    assert resume.decide(cfg) is None
    cfg.train.resume = str(elsewhere)
    assert resume.decide(cfg) == resume.Start(str(elsewhere), branches=True)
    lines.record_branch(str(own), str(elsewhere))  # a restart of the line that began there: its newest
    assert resume.decide(cfg) == resume.Start(str(own / "step-4"), branches=False)
