"""End-to-end runs of `python -m trainer`: in process, under real torchrun, resumed after a kill, swept."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DIST, REFERENCE, REPO, TINY, read_metrics, read_summary
from trainer.config.families import BY_NAME

pytestmark = pytest.mark.slow

# DDP averages two half-batch gradients where one process averages the whole batch: the same sum in
# another order, so losses agree to float32 rounding (relative 1e-6 per step), which a few steps of
# AdamW can grow by an order or two. 1e-4 is far below any real divergence (a wrong shard or a
# skipped all-reduce moves the loss by > 1e-2 within two steps).
CURVE_RTOL = 1e-4


def _losses(run_dir: str) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def test_in_process_run_writes_config_metrics_checkpoints_summary(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(*TINY, "train.max_steps=6", "train.eval_every=3", "train.checkpoint_every=2",
                   "train.keep_latest_k=2", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert f"run directory: {run_dir}" in proc.stdout
    assert sorted(os.listdir(run_dir)) == [".lock", "checkpoints", "config.yaml", "logs", "loss.png", "metrics.jsonl",
                                          "summary.json"]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step-4", "step-6"]  # keep_latest_k=2
    metrics = read_metrics(str(run_dir))
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_memory_gb"} <= set(metrics[0])
    assert [m["step"] for m in metrics if "eval_loss" in m] == [3, 6]
    summary = read_summary(str(run_dir))
    assert summary["steps"] == 6 and summary["world_size"] == 1
    assert summary["final_eval_loss"] == metrics[-1]["eval_loss"]
    assert summary["final_eval_loss"] < metrics[0]["loss"]
    assert (run_dir / "logs" / "rank-0.log").read_text().count("done: step 6") == 1
    text = (run_dir / "config.yaml").read_text()
    assert "hydra" not in text and "${" not in text and f"run_dir: {run_dir}" in text


def test_a_run_that_releases_freed_buffers_says_so_and_trains_the_same_losses(run_cli, tmp_path, single_reference):
    """train.allocator=release (auto's choice from 8192-token rows) sets glibc's policy in the rank and says so in
    its log; the losses are the default run's (auto, 32-token rows: glibc's own), to the bit. Under a user's own
    MALLOC_* setting it is not set, and the log says so."""
    run_dir = tmp_path / "run"
    proc = run_cli(*REFERENCE, "train.allocator=release", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "allocator: release (glibc maps blocks" in log and "not set" not in log
    assert "allocator:" not in (Path(single_reference) / "logs" / "rank-0.log").read_text()
    assert _losses(str(run_dir)) == _losses(single_reference)
    # A user's own malloc setting decides, and the log says why release was not set.
    user_dir = tmp_path / "user"
    proc = run_cli(*TINY, "train.max_steps=1", "train.allocator=release", f"hydra.run.dir={user_dir}",
                   env={"MALLOC_MMAP_THRESHOLD_": "4194304"})
    assert proc.returncode == 0, proc.stderr
    assert "allocator: release not set: malloc settings in the environment" in (
        user_dir / "logs" / "rank-0.log").read_text()


def test_a_multirun_in_one_process_keeps_its_first_jobs_release_and_its_later_jobs_say_so(run_cli, tmp_path):
    """glibc's settings last as long as the process: a sweep's jobs run in the driver's process one after another,
    so a later job that wants glibc's own thresholds runs under the first job's release, and its log says so."""
    proc = run_cli("-m", *TINY, "train.max_steps=1", "train.allocator=release,adaptive",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr
    first, second = ((tmp_path / "sweep" / n / "logs" / "rank-0.log").read_text() for n in ("0", "1"))
    assert "allocator: release (glibc maps blocks" in first
    assert "allocator: release stays from an earlier run in this process (train.allocator wants adaptive)" in second


def test_torchrun_ddp_matches_in_process_loss_curve(single_reference, ddp_reference):
    """The shared reference runs (tests/conftest.py): the same six steps in this process and on two ranks."""
    assert read_summary(ddp_reference)["world_size"] == 2
    assert sorted(os.listdir(os.path.join(ddp_reference, "logs"))) == ["rank-0.log", "rank-1.log"]
    a, b = _losses(single_reference), _losses(ddp_reference)
    assert len(a) == len(b) == 6
    assert b == pytest.approx(a, rel=CURVE_RTOL)
    assert read_summary(ddp_reference)["final_eval_loss"] == pytest.approx(
        read_summary(single_reference)["final_eval_loss"], rel=CURVE_RTOL)


@pytest.mark.e2e
def test_killed_run_resumes_from_its_checkpoint_and_ends_like_an_uninterrupted_one(run_cli, tmp_path, cache_dir):
    args = [*TINY, "model.dim=128", "model.n_layers=4", "train.max_steps=30", "train.eval_every=10",
            "train.checkpoint_every=10", "train.keep_latest_k=3"]
    whole = run_cli(*args, f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr

    run_dir = tmp_path / "killed"
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir}
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args, f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    first = run_dir / "checkpoints" / "step-10" / ".metadata"
    deadline = time.time() + 240
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    saved = sorted(os.listdir(run_dir / "checkpoints"))
    assert "step-10" in saved and "step-30" not in saved
    resumed_step = max(int(name.split("-")[1]) for name in saved if name.startswith("step-"))

    again = run_cli(*args, f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr
    summary = read_summary(str(run_dir))
    assert summary["resumed_from"] == str(run_dir / "checkpoints" / f"step-{resumed_step}")
    assert summary["steps"] == 30 and summary["steps_this_run"] == 30 - resumed_step
    steps = [m["step"] for m in read_metrics(str(run_dir))]
    assert steps[-(30 - resumed_step):] == list(range(resumed_step + 1, 31))
    reference = read_summary(str(tmp_path / "whole"))
    assert summary["final_train_loss"] == pytest.approx(reference["final_train_loss"], rel=1e-6)
    assert summary["final_eval_loss"] == pytest.approx(reference["final_eval_loss"], rel=1e-6)


def test_multirun_sweep_produces_one_run_per_point(run_cli, tmp_path):
    proc = run_cli("-m", *TINY, "optim.lr=1e-3,3e-4", "train.max_steps=5", "train.eval_every=5",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr
    runs = sorted(p for p in os.listdir(tmp_path / "sweep") if p.isdigit())
    assert runs == ["0", "1"]
    lrs = []
    for name in runs:
        summary = read_summary(str(tmp_path / "sweep" / name))
        assert summary["steps"] == 5
        text = (tmp_path / "sweep" / name / "config.yaml").read_text()
        lrs.append(next(line for line in text.splitlines() if line.strip().startswith("lr:")).split()[-1])
    assert lrs == ["0.001", "0.0003"]


@pytest.mark.e2e
def test_relaunch_with_a_new_config_keeps_the_old_one_and_refuses_to_overwrite_checkpoints(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(*TINY, "train.max_steps=2", "train.checkpoint_every=2", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr
    old = (run_dir / "config.yaml").read_text()

    fresh = run_cli(*TINY, "train.max_steps=2", "train.resume=never", f"hydra.run.dir={run_dir}")
    assert fresh.returncode == 2
    assert "train.resume='never'" in fresh.stderr and "already holds checkpoints" in fresh.stderr
    assert (run_dir / "config.yaml").read_text() == old

    longer = run_cli(*TINY, "train.max_steps=4", "train.checkpoint_every=2", f"hydra.run.dir={run_dir}")
    assert longer.returncode == 0, longer.stderr
    assert (run_dir / "config.1.yaml").read_text() == old
    assert "max_steps: 4" in (run_dir / "config.yaml").read_text()
    assert read_summary(str(run_dir))["resumed_from"] == str(run_dir / "checkpoints" / "step-2")


@pytest.mark.e2e
def test_training_streams_its_data_from_cache_nodes(run_cli, tmp_path, cache_dir, ddp_reference):
    from omegaconf import OmegaConf

    from trainer.data.corpus import prepare

    corpus = prepare(OmegaConf.create({"name": "stdlib", "path": None, "text_column": "text", "tokens_column": None,
                                       "seq_len": 32, "eval_percent": 2.0, "cache_dir": cache_dir}))
    sources = [os.path.join(corpus, "train")] * 2 + [os.path.join(corpus, "eval")]
    nodes = [subprocess.Popen([sys.executable, "-m", "datacache", "serve", "--source", source, "--port", "0",
                               "--shard", f"{i % 2}/{2 if i < 2 else 1}", "--token", "t"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i, source in enumerate(sources)]
    empty = tmp_path / "empty-cache"  # the run gets every row from the nodes: it builds no corpus here
    try:
        endpoints = [p.stdout.readline().split()[-1] for p in nodes]
        proc = run_cli(*REFERENCE, *DIST, f"data.cache.endpoints=[{endpoints[0]},{endpoints[1]}]",
                       f"data.cache.eval_endpoints=[{endpoints[2]}]", "data.cache.token=t",
                       f"hydra.run.dir={tmp_path / 'run'}", env={"TRAINJOB_CACHE": str(empty)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        # Rows of another length than data.seq_len + 1 are refused, naming the key.
        wrong = run_cli(*TINY, "data.seq_len=16", "train.max_steps=1", "data.cache.token=t",
                        f"data.cache.endpoints=[{endpoints[0]},{endpoints[1]}]", f"hydra.run.dir={tmp_path / 'wrong'}")
    finally:
        for p in nodes:
            p.terminate()
            p.wait(timeout=10)
    assert not (empty / "corpus").exists()
    assert wrong.returncode != 0 and "data.cache.endpoints" in wrong.stderr
    assert "data.seq_len=16 needs rows of 17 token ids" in wrong.stderr
    losses = _losses(str(tmp_path / "run"))
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert read_summary(str(tmp_path / "run"))["world_size"] == 2
    # The cache gives the batches the local corpus gives: the same run without it has the same losses.
    assert _losses(ddp_reference) == pytest.approx(losses, rel=1e-6)
    assert read_summary(ddp_reference)["final_eval_loss"] == pytest.approx(
        read_summary(str(tmp_path / "run"))["final_eval_loss"], rel=1e-6)


# kernels=triton against kernels=torch (docs/kernels.md states it): fp32 kernels that sum in other orders agree
# with PyTorch's to ~1e-6 per op; two steps of AdamW keep the losses within 1e-4 relative.
TRITON_LOSS_RTOL = 1e-4
# The families' tiny models (tests/trainer/hf_models.py) at 12 tokens: longer than their sliding windows (8).
FAMILY_RUNS = [pytest.param(name, marks=pytest.mark.e2e) for name in sorted(BY_NAME)]


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("families"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["debug", *FAMILY_RUNS])
@pytest.mark.e2e
def test_triton_kernels_give_the_same_first_losses_as_torch(run_cli, family_root, tmp_path, family):
    """`kernels=triton` under Triton's interpreter (CPU) against `kernels=torch`, on one layer of the debug
    model's shape (plain suite) and on each family's tiny model (e2e: the interpreter is slow), short sequences
    and two rows, both runs at once: the first step's loss (forward kernels), the second's (after an update
    from the backward kernels, the routed ATen ops, clipping's and ops.AdamW's) and the eval loss."""
    from tests.trainer.hf_models import make_named

    model = (["model=debug", "model.n_layers=1", "data.seq_len=8"] if family == "debug" else
             ["model=hf", f"model.path={make_named(family_root, family)}", "data.seq_len=12"])
    args = [*model, "train.global_batch_size=2", "train.max_steps=2", "train.log_every=1", "train.eval_every=2",
            "train.eval_batches=1", "train.progress=false"]
    env = {"TRITON_INTERPRET": "1"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {kernels: pool.submit(run_cli, *args, f"kernels={kernels}", f"hydra.run.dir={tmp_path / kernels}",
                                     env=env, timeout=540) for kernels in ("torch", "triton")}
    for kernels, run in runs.items():
        assert run.result().returncode == 0, f"{kernels}: {run.result().stderr[-3000:]}"
    torch_losses, triton_losses = _losses(str(tmp_path / "torch")), _losses(str(tmp_path / "triton"))
    evals = [read_summary(str(tmp_path / k))["final_eval_loss"] for k in ("torch", "triton")]
    print(f"{family}: losses torch {torch_losses} triton {triton_losses}; eval {evals[0]} {evals[1]}")
    assert len(torch_losses) == 2
    assert triton_losses == pytest.approx(torch_losses, rel=TRITON_LOSS_RTOL)
    assert evals[1] == pytest.approx(evals[0], rel=TRITON_LOSS_RTOL)


# Two runs of each: pretraining (the weights initialised by the routed normal_ under the seed) and GRPO (rollouts
# sampled by the routed multinomial and exponential_ from the recipe's seeded generator).
SEEDED_RUNS = {
    "pretrain": ["data.seq_len=8", "train.global_batch_size=2"],
    "grpo": ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", "recipe=grpo",
             "data=prompts", "data.seq_len=16", "data.eval_percent=20", "recipe.num_generations=2",
             "train.global_batch_size=4", "recipe.max_completion_length=4", "recipe.beta=0.04",
             "recipe.reward_funcs=[tests.trainer.grpo_rewards:lowercase]"],
}


@pytest.mark.timeout(600)
@pytest.mark.e2e
@pytest.mark.parametrize("recipe", ["pretrain", pytest.param("grpo", marks=pytest.mark.extended)])
def test_two_seeded_triton_runs_give_identical_losses(run_cli, tmp_path, recipe):
    """Issue 59's point 5: `kernels=triton` (every op routed, Triton's interpreter) twice with the same seed gives
    the same losses, bit for bit: the random ops draw from the seeded generators as PyTorch's do. GRPO (extended: its
    sampling under the interpreter takes minutes here) samples the same completions: the same rewards and lengths."""
    args = ["model=debug", "model.n_layers=1", *SEEDED_RUNS[recipe], "kernels=triton", "train.max_steps=2",
            "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "train.progress=false",
            "lr_schedule.warmup_steps=0"]
    if recipe == "grpo":
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(f'{{"prompt": "the cat {w}"}}\n' for w in ["sat", "ran", "on", "far"] * 5))
        args.append(f"data.path={prompts}")
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_cli, *args, f"hydra.run.dir={tmp_path / str(i)}", env=env, timeout=540)
                for i in range(2)]
    for run in runs:
        assert run.result().returncode == 0, run.result().stderr[-3000:]
    first, second = (read_metrics(str(tmp_path / str(i))) for i in range(2))
    assert len(first) == 2
    assert [m["loss"] for m in second] == [m["loss"] for m in first]
    assert [m["grad_norm"] for m in second] == [m["grad_norm"] for m in first]
    if recipe == "grpo":  # the same completions
        for key in ("reward", "completions/mean_length", "kl"):
            assert [m[key] for m in second] == [m[key] for m in first], key
    evals = [read_summary(str(tmp_path / str(i)))["final_eval_loss"] for i in range(2)]
    assert evals[0] == evals[1]


@pytest.mark.e2e
def test_killing_the_driver_stops_torchrun_and_its_ranks(tmp_path, cache_dir):
    from tests.conftest import rank_pids

    run_dir = tmp_path / "run"
    driver = subprocess.Popen([sys.executable, "-m", "trainer", *TINY, "train.max_steps=100000",
                               "+runtime=torch-distributed", "runtime.nproc_per_node=2", f"hydra.run.dir={run_dir}"],
                              cwd=tmp_path, env={**os.environ, "TRAINJOB_CACHE": cache_dir},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = run_dir / "logs" / "rank-1.log"
    deadline = time.time() + 120
    while not (log.exists() and "model" in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    assert len(rank_pids(str(run_dir / "config.yaml"))) == 2
    driver.kill()
    driver.wait()
    deadline = time.time() + 60
    while rank_pids(str(run_dir / "config.yaml")) and time.time() < deadline:
        time.sleep(0.2)
    assert rank_pids(str(run_dir / "config.yaml")) == []
