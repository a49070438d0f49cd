"""A config that cannot run is refused before anything starts: exit code 2, one line naming the key, the
value and what is allowed, no traceback and no run directory. That holds for what only the data, the
checkpoint or the cache nodes can tell too (the driver reads them before it launches), and a worker that
finds such a thing itself (on a remote launcher) says it in one line before its first step.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from datetime import timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import launchers
from datacache.order import BatchPlan
from tests.conftest import REPO, TINY, examples
from trainer import config
from trainer.config.compose import compose
from trainer.models.kernels import Kernels
from trainer.prepare.preflight import check
from trainer.training.optimizer import build_optimizer
from trainjob import runtimes

ONE_STEP = [*TINY, "train.max_steps=1", "train.eval_batches=1"]


def _refused(proc: subprocess.CompletedProcess, cwd) -> str:
    """The one line a refusal prints, after checking it is the whole story: exit 2, no traceback, no run."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid config: "), proc.stderr
    assert not (cwd / "outputs").exists(), list((cwd / "outputs").rglob("*"))
    return lines[0]


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    """Parquet files a new user might point data.path at, the wrong way or the right one."""
    root = tmp_path_factory.mktemp("parquet")
    pq.write_table(pa.table({"text": list(range(100))}), root / "ints.parquet")
    pq.write_table(pa.table({"ids": [[1, 2, 300] * 40] * 1000}), root / "beyond_vocab.parquet")
    pq.write_table(pa.table({"ids": [[1, 2, 70000] * 40] * 1000}), root / "beyond_uint16.parquet")
    docs = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (5 + i % 30) for i in range(600)]
    pq.write_table(pa.table({"text": docs}), root / "text.parquet")
    return root


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    proc = subprocess.run([sys.executable, "-m", "trainer", *ONE_STEP, f"hydra.run.dir={run_dir}"], cwd=REPO,
                          env={**os.environ, "TRAINJOB_CACHE": cache_dir}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir / "checkpoints" / "step-1"


ROWS = {
    "no parquet files": (["data=parquet", "data.path=/nonexistent/dir/*.parquet"],
                         "data.path='/nonexistent/dir/*.parquet': no Parquet files there"),
    "global batch larger than the eval split": (
        ["train.global_batch_size=65536", "data.eval_percent=2"],  # unset, a short eval split means no eval
        "train.global_batch_size=65536: the eval split holds "),
    "eval_percent that leaves no eval rows": (["data.eval_percent=0.001"],
                                              "data.eval_percent=0.001: leaves the eval split no rows"),
    "resume from a directory that is no checkpoint": (["train.resume=/tmp"],
                                                      "train.resume='/tmp': must be auto, never, or a checkpoint"),
    "negative adam eps": (["optim.eps=-1"], "optim.eps=-1.0: must be > 0"),
    "negative sgd momentum": (["optim=sgd", "optim.momentum=-1"], "optim.momentum=-1.0: must be >= 0"),
    "negative init std": (["model.init_std=-1"], "model.init_std=-1.0: must be > 0"),
    "text column of integers": (["data=parquet", "data.path={parquet}/ints.parquet"],
                                "data.text_column='text': {parquet}/ints.parquet holds int64 there, not text"),
    "token ids beyond the vocabulary": (
        ["data=parquet", "data.path={parquet}/beyond_vocab.parquet", "data.tokens_column=ids",
         "data.text_column=null"],
        "model.vocab_size=259: the corpus holds token id 300 ('ids' of data.path={parquet}/beyond_vocab.parquet): "
        "must be > 300"),
    "token ids beyond uint16": (
        ["data=parquet", "data.path={parquet}/beyond_uint16.parquet", "data.tokens_column=ids",
         "data.text_column=null"],
        "data.tokens_column='ids': {parquet}/beyond_uint16.parquet holds token id 70000: ids must be in [0, 65535]"),
    "unreachable cache node": (["data.cache.endpoints=[grpc://127.0.0.1:1]"],
                               "data.cache.endpoints=['grpc://127.0.0.1:1']: cache node grpc://127.0.0.1:1"),
    "a model larger than memory": (["model.vocab_size=1000000000"],
                                   "model='128B parameters': needs at least 1907.3 GiB per rank"),
}


@pytest.fixture(scope="module")
def cli_rows(run_cli_batch, tmp_path_factory, parquet_dir) -> dict:
    """Each row of ROWS run by the CLI in a directory of its own, all from one interpreter:
    {row: (process, directory)}."""
    dirs = {row: tmp_path_factory.mktemp("refused") for row in ROWS}
    procs = run_cli_batch([([*ONE_STEP, *(o.format(parquet=parquet_dir) for o in ROWS[row][0])], dirs[row])
                           for row in ROWS])
    return {row: (proc, dirs[row]) for row, proc in zip(ROWS, procs, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("row", list(ROWS))
def test_cli_refuses_in_one_line_with_exit_2_and_no_run_dir(cli_rows, parquet_dir, row):
    proc, cwd = cli_rows[row]
    assert ROWS[row][1].format(parquet=parquet_dir) in _refused(proc, cwd)


@pytest.mark.slow
@pytest.mark.e2e
def test_cli_refuses_a_checkpoint_of_another_model_shape(run_cli, tmp_path, saved_checkpoint):
    proc = run_cli(*ONE_STEP, f"train.resume={saved_checkpoint}", "model.dim=128", timeout=240)
    line = _refused(proc, tmp_path)
    assert f"train.resume='{saved_checkpoint}': the checkpoint {saved_checkpoint} holds model tensor " in line
    assert "layers.0.attention.wk.weight of shape (32, 64), this config's model (64, 128)" in line


@pytest.mark.slow
def test_a_worker_that_finds_bad_data_says_so_in_one_line_before_its_first_step(tmp_path, cache_dir):
    """On a remote launcher the driver cannot read the data; the worker runs the same checks first."""
    from omegaconf import OmegaConf

    from tests.conftest import compose_run

    run = compose_run(tmp_path, *ONE_STEP)
    cfg = OmegaConf.load(run.spec.config_path)
    cfg.train.global_batch_size = 65536
    cfg.data.eval_percent = 2  # unset, an eval split short of a step would mean a run without eval
    OmegaConf.save(cfg, run.spec.config_path)
    proc = subprocess.run([sys.executable, "-m", "trainer.worker", run.spec.config_path], cwd=tmp_path,
                          env={**os.environ, "TRAINJOB_CACHE": cache_dir}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: invalid config: train.global_batch_size=65536: the eval split holds")
    assert not os.path.exists(os.path.join(run.spec.run_dir, "metrics.jsonl"))


# --- random values for every numeric key of the schema ------------------------------------------------

def _numeric_keys() -> list[tuple[str, type, list[str]]]:
    """(key, type, overrides that make the key's section part of the config) for every number in the schema."""
    distributed = ["+runtime=torch-distributed", "runtime.nproc_per_node=2"]
    keys = [(key, kind, []) for group, schema in config.SCHEMAS.items()
            for key, kind in config.numeric_keys(schema, group)]
    for name, schema in runtimes.schemas().items():  # each runtime's own keys
        keys += [(key, kind, [f"runtime={name}", "runtime.nproc_per_node=2"])
                 for key, kind in config.numeric_keys(schema, "runtime")]
    for name, schema in launchers.LAUNCHER_SCHEMAS.items():
        extra = [f"launcher={name}", "launcher.image=img", *distributed]
        keys += [(key, kind, extra) for key, kind in config.numeric_keys(schema, "launcher")]
    return keys


NUMERIC_KEYS = _numeric_keys()
DEFAULT_GROUPS = ("model", "data", "strategy", "optim", "train")


def _value(kind: type, small: bool):
    """Edge values often (where most rules draw their lines), any others too; `small` keeps a run cheap."""
    if kind is int:
        edges = st.sampled_from([-1, 0, 1, 2])
        return st.one_of(edges, st.integers(-3, 24) if small else st.integers(-2**63, 2**63))
    edges = st.sampled_from([-1.0, 0.0, 1.0, float("nan"), float("inf"), 1e-300])
    return st.one_of(edges, st.floats(allow_nan=True, allow_infinity=True))


def _override(key: str, value) -> str:
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"


@st.composite
def _numeric_overrides(draw, keys, small: bool) -> list[str]:
    chosen = draw(st.lists(st.sampled_from(keys), min_size=1, max_size=4, unique_by=lambda k: k[0]))
    # One value per overridden key (`+runtime=X` is `runtime=X`): a key of another launcher's or runtime's schema
    # than the first drawn's is left.
    first: dict[str, str] = {}
    for _, _, more in chosen:
        for o in more:
            first.setdefault(o.lstrip("+").split("=")[0], o.lstrip("+"))
    chosen = [k for k in chosen if all(first[o.lstrip("+").split("=")[0]] == o.lstrip("+") for o in k[2])]
    extra = sorted({o for _, _, more in chosen for o in more})
    return [*extra, *(_override(key, draw(_value(kind, small))) for key, kind, _ in chosen)]


def test_the_property_covers_every_numeric_key_of_the_schema():
    keys = {key for key, _, _ in NUMERIC_KEYS}
    assert {"model.init_std", "optim.eps", "optim.momentum", "data.cache.prefetch", "train.seed",
            "runtime.monitor_interval", "launcher.resources_per_node.gpu", "launcher.poll_seconds"} <= keys
    assert "optim.betas" not in keys  # a list, checked as one


def _text_data(parquet_dir) -> list[str]:
    return ["data=parquet", f"data.path={parquet_dir}/text.parquet"]


@pytest.mark.timeout(120)
@settings(max_examples=examples(20), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=_numeric_overrides(NUMERIC_KEYS, small=False))
def test_any_numbers_pass_the_checks_or_are_refused_in_one_line(overrides, parquet_dir, cache_dir, monkeypatch):
    """The driver's own check (the CLI's, without the process): accepted, or one ConfigError line."""
    monkeypatch.setenv("TRAINJOB_CACHE", cache_dir)
    cfg = compose([*TINY, *_text_data(parquet_dir), *overrides])
    cfg.run_dir = "/nonexistent/run"
    try:
        check(cfg)
    except config.ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("invalid config: ")
        return
    # What the checks accept, the parts that take these numbers accept too.
    build_optimizer(cfg.optim, torch.nn.Linear(2, 2), Kernels.of(cfg.kernels, cfg.optim).optimizer)
    BatchPlan(num_rows=16, global_batch_size=8, seed=cfg.train.seed).epoch_order(1)
    torch.empty(2).normal_(0.0, cfg.model.init_std, generator=torch.Generator().manual_seed(cfg.train.seed))


_runs = itertools.count()


@pytest.mark.slow
@pytest.mark.timeout(300)
@settings(max_examples=examples(4), deadline=timedelta(seconds=120),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=_numeric_overrides([k for k in NUMERIC_KEYS if k[0].split(".")[0] in DEFAULT_GROUPS], small=True))
def test_any_numbers_train_or_are_refused_in_one_line_never_a_traceback(overrides, run_cli, tmp_path, parquet_dir):
    chosen = {o.split("=")[0] for o in overrides}
    base = [o for o in [*ONE_STEP, *_text_data(parquet_dir)] if o.split("=")[0] not in chosen]
    run_dir = tmp_path / f"run-{next(_runs)}"
    proc = run_cli(*base, *overrides, f"hydra.run.dir={run_dir}", timeout=240)
    assert "Traceback" not in proc.stdout + proc.stderr, (overrides, proc.stderr[-3000:])
    if proc.returncode == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (overrides, proc.stderr[-3000:])
        assert not run_dir.exists()
    else:
        assert proc.returncode == 0, (overrides, proc.stderr[-3000:])
