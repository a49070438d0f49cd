"""Shared fixtures: a tiny model's overrides, a shared corpus cache, runners for the real CLI, the reference
runs that several modules compare against, and the Hypothesis profiles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch  # importing torch does not import triton
from hypothesis import settings

from trainjob.run_files import RunDir

pytest_plugins = ["tests.s3_server", "tests.hub_server"]

# Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors; it must be chosen before
# triton is imported anywhere in the test session. Tests of what happens without it unset it themselves.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model and batch small enough that a step takes milliseconds on one CPU core; a metrics line every
# step, so that tests compare whole loss curves.
TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "data.seq_len=32", "train.global_batch_size=8", "lr_schedule.warmup_steps=2", "train.progress=false",
    "train.log_every=1",
]


# Property tests: `pytest` (what CI runs) tries the examples each test asks for through `examples(n)`, sized
# so that a test takes seconds; HYPOTHESIS_PROFILE=deep tries ten times as many. A deadline per example, far
# above what one takes, turns an example that hangs or crawls into a failure that names it.
settings.register_profile("ci", deadline=timedelta(seconds=30))
settings.register_profile("deep", deadline=timedelta(seconds=30))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(n: int) -> int:
    return n * 10 if settings.get_current_profile_name() == "deep" else n  # (hypothesis >= 6.139)


@pytest.fixture(scope="session", autouse=True)
def job_registry(tmp_path_factory):
    """Local jobs that the tests start go on record in a registry of the session's own, not the user's."""
    os.environ["TRAINJOB_HOME"] = str(tmp_path_factory.mktemp("trainjob-home"))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def cli(cache_dir: str, cwd, *args: str, module: str = "trainer", timeout: float = 300,
        env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m <module> *args` in `cwd` with the test cache; return the process."""
    full_env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=str(cwd), env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def run_cli(cache_dir, tmp_path):
    """`cli` in `tmp_path` (or `cwd`)."""

    def run(*args: str, module: str = "trainer", cwd: str | None = None, timeout: float = 300,
            env: dict | None = None) -> subprocess.CompletedProcess:
        return cli(cache_dir, cwd or tmp_path, *args, module=module, timeout=timeout, env=env)

    return run


@pytest.fixture(scope="session")
def run_cli_batch(cache_dir):
    """Run `python -m <module> *args` for each (args, cwd) from one interpreter, forking a process per run
    (tests/cli_batch.py): for configs that are refused, where the interpreter's start is most of the time.
    Returns one finished process per run, as `run_cli` does."""

    def run(runs: list[tuple[list[str], str]], module: str = "trainer",
            timeout: float = 300) -> list[subprocess.CompletedProcess]:
        env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
        request = [{"args": list(args), "cwd": str(cwd), "env": {}} for args, cwd in runs]
        batch = subprocess.run([sys.executable, "-m", "tests.cli_batch", module], cwd=REPO, env=env,
                               input=json.dumps(request), capture_output=True, text=True, timeout=timeout)
        assert batch.returncode == 0, batch.stderr[-3000:]
        return [subprocess.CompletedProcess([sys.executable, "-m", module, *args], r["returncode"], r["stdout"],
                                            r["stderr"]) for (args, _), r in zip(runs, json.loads(batch.stdout),
                                                                                 strict=True)]

    return run


# The runs that tests in several modules compare with: six tiny steps in this process, and the same six
# steps as two DDP ranks under torchrun (the default strategy), each on the local corpus.
REFERENCE = [*TINY, "train.max_steps=6", "train.eval_every=3", "train.checkpoint_every=100"]
DIST = ["+runtime=torch-distributed", "runtime.nproc_per_node=2"]


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory, cache_dir) -> str:
    """The run directory of REFERENCE in one process."""
    run_dir = tmp_path_factory.mktemp("single-reference") / "run"
    proc = cli(cache_dir, run_dir.parent, *REFERENCE, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(run_dir)


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory, cache_dir) -> str:
    """The run directory of REFERENCE on two ranks under torchrun."""
    run_dir = tmp_path_factory.mktemp("ddp-reference") / "run"
    proc = cli(cache_dir, run_dir.parent, *REFERENCE, *DIST, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(run_dir)


def compose_run(tmp_path, *overrides: str):
    """A prepared `Run` (validated, resolved, saved under tmp_path/run) for `python -m trainer *overrides`: the
    keys set there are checked as the command line's are (read by the chosen options)."""
    from trainer.__main__ import prepare_run
    from trainer.config import readers
    from trainer.config.compose import compose

    cfg = compose(overrides)
    cfg.run_dir = str(tmp_path / "run")
    return prepare_run(cfg, readers.given_keys(overrides))


def compose_refused(tmp_path, capsys, *overrides: str) -> str:
    """What `compose_run(*overrides)` prints on stderr as it refuses the config with exit 2."""
    with pytest.raises(SystemExit) as e:
        compose_run(tmp_path, *overrides)
    assert e.value.code == 2
    return capsys.readouterr().err


def read_metrics(run_dir: str) -> list[dict]:
    """The run's step lines (not its events: re-formations, resumes)."""
    with open(RunDir.of(run_dir).metrics) as f:
        return [r for r in map(json.loads, f) if "event" not in r]


def read_summary(run_dir: str) -> dict:
    with open(RunDir.of(run_dir).summary) as f:
        return json.load(f)


def process_environment(pid: int) -> dict[str, str]:
    """The environment process `pid` runs with (as its exec, the last one, gave it)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(v.decode(errors="replace").split("=", 1) for v in f.read().split(b"\0") if b"=" in v)


def rank_pids(config_path: str) -> list[int]:
    """The pids of the ranks that train from `config_path`: python processes whose module (`-m`) is
    trainer.worker, whatever started them (torchrun's agent, whose own module is
    trainjob.runtimes.torch_distributed.torchrun, or mpirun)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if (os.path.basename(args[0]).startswith(b"python") and b"-m" in args[:-1]
                and args[args.index(b"-m") + 1] == b"trainer.worker" and config_path.encode() in args):
            pids.append(int(pid))
    return sorted(pids)


def kill_a_rank_at_first_checkpoint(args: list[str], run_dir, cache_dir: str, first_step: int,
                                    timeout: float) -> tuple[int, str]:
    """Run `python -m trainer *args` into `run_dir`, SIGKILL its second rank once checkpoint `first_step` is
    written, and return the driver's exit code and output (within `timeout` seconds of the kill)."""
    driver = subprocess.Popen([sys.executable, "-m", "trainer", *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                              env={**os.environ, "TRAINJOB_CACHE": cache_dir}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = run_dir / "checkpoints" / f"step-{first_step}" / ".metadata"
        deadline = time.time() + 240
        while not first.exists() and driver.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        victims = rank_pids(str(run_dir / "config.yaml"))
        assert len(victims) == 2, victims
        os.kill(victims[1], signal.SIGKILL)
        out, _ = driver.communicate(timeout=timeout)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    return driver.returncode, out
