"""trainjob.run_files: the readers take what a kill or a full disk left (a summary cut short is none, lines of
another kind are skipped), and the paths of a run directory's files are named once."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from trainjob.run_files import RunDir, read_progress, read_summary


@settings(max_examples=25)
@given(cut=st.integers(0, 60), junk=st.lists(st.sampled_from(["[1]", "7", '"s"', "null", '{"step": 2, "lo'])))
def test_a_cut_summary_or_metrics_lines_of_another_kind_read_as_missing(tmp_path_factory, cut, junk):
    run = tmp_path_factory.mktemp("run")
    summary = json.dumps({"steps": 3, "final_train_loss": 1.5, "final_eval_loss": 1.25})
    (run / "metrics.jsonl").write_text("\n".join([json.dumps({"step": 1, "loss": 2.0}), *junk]) + "\n")
    (run / "summary.json").write_text(summary[:cut])
    assert read_summary(str(run)) is None
    assert read_progress(str(run)) == {"step": 1, "loss": 2.0, "eval_loss": None}


def test_a_run_directory_lists_its_error_reports_and_node_slots(tmp_path):
    paths = RunDir(str(tmp_path))
    (tmp_path / "logs").mkdir()
    for name in ("rank-0.error", "rank-12.error", "rank-x.error", "rank-1.log"):
        (tmp_path / "logs" / name).write_text("report")
    (tmp_path / ".node-1.lock").write_text("")
    assert paths.error_reports() == {0: paths.error_report(0), 12: paths.error_report(12)}
    assert paths.node_slots() == [paths.node_slot(1)]
    assert not paths.is_run()
    (tmp_path / "config.yaml").write_text("run_dir: x\n")
    (tmp_path / "summary.json").write_text("{}")
    assert paths.is_run()
