"""Damaged or hostile inputs that need no training: a corpus cache missing corpus.json or a shard, or a
killed build's temporary directory (rebuilt, removed); report inputs cut short or of the wrong kind; paths
that cannot become a writable directory; values Hydra or OmegaConf cannot take. Each is one line naming
the file or key, or a rebuild with a warning, and leaves nothing half-written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from trainer.data import corpus as data
from trainer.observability import report


def _writer(calls: list):
    def write(tmp: str) -> dict:
        calls.append(tmp)
        rows = data._write_rows([np.arange(1, 200, dtype=np.uint16)], 8, os.path.join(tmp, "train"))
        data._write_rows([np.arange(1, 40, dtype=np.uint16)], 8, os.path.join(tmp, "eval"))
        return {"rows": {"train": rows, "eval": 4}, "max_token_id": 199}
    return write


def _damage(corpus: str, kind: str) -> None:
    shard = os.path.join(corpus, "train", "shard-00000.parquet")
    if kind == "no corpus.json":
        os.remove(os.path.join(corpus, "corpus.json"))
    elif kind == "cut corpus.json":
        with open(os.path.join(corpus, "corpus.json"), "r+") as f:
            f.truncate(10)
    elif kind == "cut shard":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    elif kind == "no shard":
        os.remove(shard)


@settings(max_examples=examples(12), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["no corpus.json", "cut corpus.json", "cut shard", "no shard", "none"]),
       killed_build=st.booleans())
def test_a_damaged_corpus_cache_is_built_again_and_a_killed_build_leaves_nothing(tmp_path_factory, kind,
                                                                                killed_build, caplog):
    cache = str(tmp_path_factory.mktemp("cache"))
    calls: list = []
    corpus = data.build_once(cache, "toy", {"v": 1}, _writer(calls))
    _damage(corpus, kind)
    root = os.path.dirname(corpus)
    if killed_build:  # what a build killed midway leaves: its temporary directory
        os.makedirs(os.path.join(root, f".{os.path.basename(corpus)}-killed", "train"))
        if kind == "none":
            _damage(corpus, "no corpus.json")
    caplog.clear()
    assert data.build_once(cache, "toy", {"v": 1}, _writer(calls)) == corpus
    damaged = kind != "none" or killed_build
    assert len(calls) == 1 + damaged
    assert data.corpus_damage(corpus) is None
    assert sorted(n for n in os.listdir(root) if not n.endswith(".lock")) == [os.path.basename(corpus)]
    if damaged:
        assert any("is damaged" in r.getMessage() and corpus in r.getMessage() for r in caplog.records)


@pytest.fixture
def one_run(tmp_path):
    run = tmp_path / "sweep" / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"run_dir: {run}\ntrain:\n  global_batch_size: 4\ndata:\n  seq_len: 8\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 1, "final_train_loss": 3.0}))
    return run


@settings(max_examples=examples(15), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.sampled_from(["", "[1, 2]", "a: [1", "7", "a: {b"]))
def test_a_config_yaml_that_is_no_config_is_one_line_naming_it(one_run, config, capsys):
    (one_run / "config.yaml").write_text(config)
    assert report.main([str(one_run.parent)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {one_run / 'config.yaml'}: not a run's config")
    assert sorted(p.name for p in one_run.parent.iterdir()) == ["run"]


@settings(max_examples=examples(15), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 20), junk=st.lists(st.sampled_from(["[1]", "3", "null", '{"step": "x"}']), max_size=3))
def test_a_cut_summary_and_foreign_metrics_lines_still_give_a_row(one_run, cut, junk, capsys):
    (one_run / "summary.json").write_text(json.dumps({"steps": 1, "final_train_loss": 3.0})[:cut])
    with open(one_run / "metrics.jsonl", "a") as f:
        f.write("".join(line + "\n" for line in junk))
    rows, _ = report.collect([str(one_run)])
    assert (rows[0].steps, rows[0].final_train_loss) == (1, 3.0)
    assert f"warning: {one_run / 'summary.json'} is not a run's summary" in capsys.readouterr().err


def test_the_report_counts_a_runs_events_and_skips_a_line_cut_short(one_run):
    (one_run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "preemption", "time": "t0", "at_step": 1}, {"event": "resume", "time": "t1", "resumed_from_step": 1},
        {"event": "reformation", "time": "t2"}, {"event": "resume", "time": "t3"}]) + '{"event": "resu')
    rows, _ = report.collect([str(one_run)])
    assert rows[0].events == "1 preemption, 2 resume, 1 reformation"
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(report.table(rows))
    text = console.export_text()
    assert "events" in text and "1 preemption, 2 resume, 1 reformation" in text


def test_report_output_that_cannot_be_written_is_refused_before_anything(one_run, capsys):
    (one_run.parent / "taken.png").mkdir()
    for output, says in ((one_run.parent / "taken.png", "is a directory"),
                         ("/sys/trainjob-report.png", "not writable")):
        assert report.main([str(one_run), "-o", str(output)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    assert sorted(p.name for p in one_run.parent.iterdir()) == ["run", "taken.png"]
    assert not list(one_run.parent.rglob("*.tmp"))

