"""Shared fixtures: a tiny model's overrides, a shared corpus cache, and a runner for the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch  # importing torch does not import triton

from trainer.run_dir import RunDir

# Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors; it must be chosen before
# triton is imported anywhere in the test session. Tests of what happens without it unset it themselves.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model and batch small enough that a step takes milliseconds on one CPU core; a metrics line every
# step, so that tests compare whole loss curves.
TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "data.seq_len=32", "train.global_batch_size=8", "optim.warmup_steps=2", "train.progress=false",
    "train.log_every=1",
]


@pytest.fixture(scope="session", autouse=True)
def job_registry(tmp_path_factory):
    """Local jobs that the tests start go on record in a registry of the session's own, not the user's."""
    os.environ["TRAINJOB_HOME"] = str(tmp_path_factory.mktemp("trainjob-home"))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def run_cli(cache_dir, tmp_path):
    """Run `python -m <module> *args` in `tmp_path` (or `cwd`) with the test cache; return the process."""

    def run(*args: str, module: str = "trainer", cwd: str | None = None, timeout: float = 300,
            env: dict | None = None) -> subprocess.CompletedProcess:
        full_env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1", **(env or {})}
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd or str(tmp_path), env=full_env,
                              capture_output=True, text=True, timeout=timeout)

    return run


def compose_run(tmp_path, *overrides: str):
    """A prepared `Run` (validated, resolved, saved under tmp_path/run) for `python -m trainer *overrides`."""
    from hydra import compose, initialize_config_dir

    from trainer import config
    from trainer.__main__ import prepare_run

    config.register()
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    cfg.run_dir = str(tmp_path / "run")
    return prepare_run(cfg)


def compose_refused(tmp_path, capsys, *overrides: str) -> str:
    """What `compose_run(*overrides)` prints on stderr as it refuses the config with exit 2."""
    with pytest.raises(SystemExit) as e:
        compose_run(tmp_path, *overrides)
    assert e.value.code == 2
    return capsys.readouterr().err


def read_metrics(run_dir: str) -> list[dict]:
    with open(RunDir(run_dir).metrics) as f:
        return [json.loads(line) for line in f]


def read_summary(run_dir: str) -> dict:
    with open(RunDir(run_dir).summary) as f:
        return json.load(f)
