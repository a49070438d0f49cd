"""`runtime=mpi` end to end: OpenMPI's real mpirun starts the ranks on this machine, which join torch.distributed
(gloo) from OMPI_COMM_WORLD_*; the same seed gives torchrun's losses under ddp and fsdp2, tp and fsdp2_tp run, a
killed rank ends the job with its exit code, and the relaunch resumes to the uninterrupted run's final loss. What
cannot run is refused before anything starts: exit 2, one line, no run directory.

mpirun comes from the Debian package openmpi-bin (README's install, .ci/run): without it these tests fail."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import DIST, REFERENCE, TINY, kill_a_rank_at_first_checkpoint, rank_pids, read_metrics, read_summary

pytestmark = pytest.mark.slow

MPI = ["runtime=mpi", "runtime.nproc_per_node=2"]
# The same ranks, data and collectives in the same order as under torchrun (one thread a rank under both): only
# the process starter differs, so the losses agree to float32 rounding at most.
RTOL = 1e-6


def _losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(str(run_dir))]


def test_mpirun_is_installed():
    assert shutil.which("mpirun"), "runtime=mpi needs OpenMPI's mpirun: apt-get install -y openmpi-bin"


@pytest.mark.e2e
def test_mpi_ddp_gives_torchruns_losses(run_cli, tmp_path, ddp_reference):
    proc = run_cli(*REFERENCE, *MPI, f"hydra.run.dir={tmp_path / 'mpi'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(str(tmp_path / "mpi"))
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"
    assert sorted(os.listdir(tmp_path / "mpi" / "logs")) == ["rank-0.log", "rank-1.log"]
    assert len(_losses(tmp_path / "mpi")) == 6
    assert _losses(tmp_path / "mpi") == pytest.approx(_losses(ddp_reference), rel=RTOL)
    assert summary["final_eval_loss"] == pytest.approx(read_summary(ddp_reference)["final_eval_loss"], rel=RTOL)


@pytest.mark.e2e
def test_mpi_fsdp2_gives_torchruns_losses(run_cli, tmp_path):
    torch = run_cli(*REFERENCE, *DIST, "strategy=fsdp2", f"hydra.run.dir={tmp_path / 'torch'}")
    assert torch.returncode == 0, torch.stderr[-3000:]
    mpi = run_cli(*REFERENCE, *MPI, "strategy=fsdp2", f"hydra.run.dir={tmp_path / 'mpi'}")
    assert mpi.returncode == 0, mpi.stderr[-3000:]
    assert _losses(tmp_path / "mpi") == pytest.approx(_losses(tmp_path / "torch"), rel=RTOL)


@pytest.mark.e2e  # two more runs on two ranks; tp and fsdp2_tp's losses: parallel/test_strategies.py, under torchrun
def test_mpi_runs_tp_and_fsdp2_tp(run_cli, tmp_path):
    for strategy in ("tp", "fsdp2_tp"):
        run = run_cli(*TINY, "train.max_steps=3", *MPI, f"strategy={strategy}", f"hydra.run.dir={tmp_path / strategy}")
        assert run.returncode == 0, run.stderr[-3000:]
        summary = read_summary(str(tmp_path / strategy))
        assert summary["steps"] == 3 and summary["world_size"] == 2 and summary["strategy"] == strategy


@pytest.mark.e2e  # three runs of 24 steps on two ranks
def test_a_killed_rank_ends_the_job_with_its_exit_code_and_the_relaunch_ends_at_the_same_loss(
        run_cli, tmp_path, cache_dir):
    steps = 24
    args = [*TINY, "model.dim=128", "model.n_layers=4", f"train.max_steps={steps}", "train.eval_every=8",
            "train.checkpoint_every=8", "train.keep_latest_k=3", *MPI]
    whole = run_cli(*args, f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]

    run_dir = tmp_path / "killed"
    code, out = kill_a_rank_at_first_checkpoint(args, run_dir, cache_dir, first_step=8, timeout=120)
    # mpirun stops the job, its exit code the killed rank's (128 + SIGKILL); the driver says so, and fails.
    assert code == 1, out[-3000:]
    assert "exited on signal 9" in out and "with exit code 137" in out, out[-3000:]
    assert not rank_pids(str(run_dir / "config.yaml"))  # nothing left running

    again = run_cli(*args, f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    summary, reference = read_summary(str(run_dir)), read_summary(str(tmp_path / "whole"))
    assert summary["resumed_from"] in {str(run_dir / "checkpoints" / f"step-{s}") for s in (8, 16)}
    assert summary["steps"] == steps
    assert [m["step"] for m in read_metrics(str(run_dir))] == list(range(1, steps + 1))
    assert _losses(run_dir) == pytest.approx(_losses(tmp_path / "whole"), rel=RTOL)
    assert summary["final_eval_loss"] == pytest.approx(reference["final_eval_loss"], rel=RTOL)


@pytest.mark.parametrize(("overrides", "env", "line"), [
    (["runtime.nnodes=1:4"], {}, "error: invalid config: runtime.nnodes='1:4': runtime=mpi jobs are fixed-size "
                                 "(mpirun starts a fixed set of ranks): give a node count N"),
    (["runtime.nnodes=2"], {}, "error: invalid config: runtime.nnodes=2: runtime=mpi starts every node's ranks from "
                               "one launcher over SSH: on this machine it runs one node; several nodes run with "
                               "launcher=docker or launcher=kubernetes"),
    ([], {"PATH": "/nonexistent"}, "error: invalid config: runtime='mpi': runtime=mpi needs OpenMPI's mpirun, which "
                                   "is not on PATH: install the Debian package openmpi-bin (apt-get install -y "
                                   "openmpi-bin, as root)"),
], ids=["elastic-range", "several-local-nodes", "no-mpirun"])
def test_what_mpi_cannot_run_is_one_line_exit_2_and_no_run_directory(run_cli, tmp_path, overrides, env, line):
    run_dir = tmp_path / "run"
    proc = run_cli(*TINY, *MPI, *overrides, f"hydra.run.dir={run_dir}", env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == line
    assert not run_dir.exists()
