"""Every parallelism strategy trains the same model to the same loss curve, checkpoints reshard across
strategies and world sizes, and a job whose rank is killed restarts and ends as if nothing happened.

All of it runs real torchrun processes with gloo collectives on the CPU.
"""

from __future__ import annotations

import pytest

from tests.conftest import DIST, REFERENCE, TINY, kill_a_rank_at_first_checkpoint, read_metrics, read_summary

pytestmark = pytest.mark.slow

# Every strategy computes the same sums in other orders (sharded matmuls, reduce-scatters, partial
# norms), so per-step losses differ by float32 rounding: relative ~1e-7, grown by a few AdamW steps to
# ~1e-6 at most (measured). 1e-4 leaves room for that and still catches any real error: a wrong shard,
# a missing gradient reduction or a mis-scaled loss moves the loss by > 1e-2 within two steps.
RTOL = 1e-4
STEPS = 6
ARGS = REFERENCE  # six steps, the shared single-process reference's

# "ddp" is the session's shared two-rank reference run (conftest.ddp_reference: REFERENCE on DIST, whose
# default strategy is ddp); the others run here.
VARIANTS = {
    "single-selective-ac-compiled": ["strategy.activation_checkpointing=selective", "strategy.compile=true"],
    "ddp": None,
    "fsdp2": [*DIST, "strategy=fsdp2"],
    "fsdp2-full-ac": [*DIST, "strategy=fsdp2", "strategy.activation_checkpointing=full"],
    "tp": [*DIST, "strategy=tp"],
    "tp-no-loss-parallel": [*DIST, "strategy=tp", "strategy.loss_parallel=false"],
    "fsdp2_tp": [*DIST, "strategy=fsdp2_tp"],
    "fsdp2_tp-4-ranks": ["+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2_tp"],
    "hsdp-4-ranks": ["+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2",
                     "strategy.dp_replicate=2"],
}


@pytest.fixture(scope="module")
def reference(single_reference):
    return read_metrics(single_reference), read_summary(single_reference)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.e2e
def test_strategy_reproduces_the_single_process_loss_curve(run_cli, tmp_path, reference, variant, request):
    if VARIANTS[variant] is None:
        run_dir = request.getfixturevalue("ddp_reference")
    else:
        run_dir = tmp_path / variant
        proc = run_cli(*ARGS, *VARIANTS[variant], f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, summary = read_metrics(str(run_dir)), read_summary(str(run_dir))
    ref_metrics, ref_summary = reference
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in ref_metrics], rel=RTOL)
    assert [m["grad_norm"] for m in metrics] == pytest.approx([m["grad_norm"] for m in ref_metrics], rel=RTOL)
    assert summary["final_eval_loss"] == pytest.approx(ref_summary["final_eval_loss"], rel=RTOL)
    assert len(summary["peak_memory_gb_per_rank"]) == summary["world_size"]


def resumes_in_one_process(run_cli, tmp_path, strategy: list[str], rtol: float = RTOL) -> tuple[list[str], dict]:
    """Eight tiny steps under `strategy` (its overrides) in tmp_path/sharded, its step-4 checkpoint resumed in one
    process in tmp_path/one, whose steps 5-8 and final eval loss must be the uninterrupted run's. (The runs'
    arguments, the one-process run's summary.)"""
    args = [*TINY, "train.max_steps=8", "train.eval_every=4", "train.checkpoint_every=4"]
    sharded = run_cli(*args, *strategy, f"hydra.run.dir={tmp_path / 'sharded'}")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    checkpoint = tmp_path / "sharded" / "checkpoints" / "step-4"
    single = run_cli(*args, f"train.resume={checkpoint}", f"hydra.run.dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-3000:]
    summary = read_summary(str(tmp_path / "one"))
    assert summary["resumed_from"] == str(checkpoint) and summary["steps_this_run"] == 4
    resumed, original = read_metrics(str(tmp_path / "one")), read_metrics(str(tmp_path / "sharded"))
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in original[4:]], rel=rtol)
    assert summary["final_eval_loss"] == pytest.approx(read_summary(str(tmp_path / "sharded"))["final_eval_loss"],
                                                       rel=rtol)
    return args, summary


@pytest.mark.e2e
def test_checkpoint_from_fsdp2_on_two_ranks_resumes_under_ddp_on_one(run_cli, tmp_path):
    args, summary = resumes_in_one_process(run_cli, tmp_path, [*DIST, "strategy=fsdp2"])

    # And back: the single-rank checkpoint loads into tensor-parallel shards.
    back = run_cli(*args, "train.max_steps=8", *DIST, "strategy=tp",
                   f"train.resume={tmp_path / 'one' / 'checkpoints' / 'step-8'}", "train.max_steps=8",
                   f"hydra.run.dir={tmp_path / 'tp'}")
    assert back.returncode == 0, back.stderr[-3000:]
    assert read_summary(str(tmp_path / "tp"))["final_eval_loss"] == pytest.approx(summary["final_eval_loss"],
                                                                                  rel=RTOL)


@pytest.mark.e2e
def test_a_killed_rank_restarts_the_job_from_its_checkpoint_with_no_batch_lost_or_repeated(
        run_cli, tmp_path, cache_dir):
    steps = 24
    args = [*TINY, "model.dim=128", "model.n_layers=4", f"train.max_steps={steps}", "train.eval_every=8",
            "train.checkpoint_every=8", "train.keep_latest_k=3", *DIST, "strategy=fsdp2"]
    whole = run_cli(*args, f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]

    run_dir = tmp_path / "killed"
    code, out = kill_a_rank_at_first_checkpoint([*args, "runtime.max_restarts=1"], run_dir, cache_dir, first_step=8,
                                                timeout=300)
    assert code == 0, out[-3000:]
    # torchrun saw a worker fail (the killed one, or its peer whose collective broke) and restarted both.
    assert "failed (exitcode" in out and "resumed from" in out, out[-3000:]

    summary = read_summary(str(run_dir))
    assert summary["steps"] == steps
    assert summary["resumed_from"] in {str(run_dir / "checkpoints" / f"step-{s}") for s in (8, 16)}
    resumed_at = int(summary["resumed_from"].rsplit("-", 1)[1])
    assert summary["steps_this_run"] == steps - resumed_at
    metrics, reference = read_metrics(str(run_dir)), read_metrics(str(tmp_path / "whole"))
    # One timeline, every step once; equal losses at every step mean the same batches in the same order.
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in reference], rel=1e-5)
    assert summary["final_eval_loss"] == pytest.approx(read_summary(str(tmp_path / "whole"))["final_eval_loss"],
                                                       rel=1e-5)
