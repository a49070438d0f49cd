"""Metrics lines come every `train.log_every` steps (10 by default, as in TorchTitan): only a line waits for
the device, while the progress bar moves every step."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, read_metrics, read_summary

pytestmark = pytest.mark.slow


def test_a_line_every_log_every_steps_and_the_bar_every_step(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    args = [o for o in TINY if not o.startswith(("train.log_every", "train.progress"))]
    proc = run_cli(*args, "train.max_steps=25", "train.eval_every=20", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(str(run_dir))
    assert [m["step"] for m in metrics] == [10, 20, 25]  # the default interval, and the last step
    assert [m["step"] for m in metrics if "eval_loss" in m] == [20, 25]
    # A line's step time is the mean over the steps since the previous line.
    gap = metrics[2]["elapsed_s"] - metrics[1]["elapsed_s"]
    assert 0 < metrics[2]["step_time_s"] * 5 <= gap
    summary = read_summary(str(run_dir))
    assert summary["final_train_loss"] == metrics[-1]["loss"]
    # Token rows have no padding: a line's real tokens are its steps' global batches of data.seq_len tokens,
    # every one trained; tokens/s is of them, and the summary holds the totals.
    for before, line in zip([0, 10, 20], metrics, strict=True):
        steps = line["step"] - before
        assert line["tokens"] == line["trained_tokens"] == steps * 8 * 32
        assert line["tokens_per_s"] * line["step_time_s"] * steps == pytest.approx(line["tokens"], rel=1e-9)
    assert summary["tokens"] == summary["trained_tokens"] == 25 * 8 * 32
    assert "25/25" in proc.stderr  # the progress bar counted every step
