"""`runtime=deepspeed-distributed strategy=deepspeed` end to end: OpenMPI's real mpirun starts two CPU ranks (gloo)
that train with the real DeepSpeed engine (PyPI's `deepspeed`, the `deepspeed` extra). Each ZeRO stage's losses
over 20 steps are one process's (no DeepSpeed) within 1e-5; DeepSpeed's own checkpoint resumes to the same next
losses; the export gathers ZeRO-3's partitions into safetensors that transformers loads, holding the one-process
run's weights. What cannot run is refused before anything starts: exit 2, one line, no run directory."""

from __future__ import annotations

import functools
import os

import pytest

from tests.conftest import TINY, read_metrics, read_summary

pytestmark = pytest.mark.slow

STEPS = 20
RUN = [*TINY, f"train.max_steps={STEPS}", "train.eval_every=10", "train.checkpoint_every=10", "train.keep_latest_k=2"]
DEEPSPEED = ["runtime=deepspeed-distributed", "strategy=deepspeed", "runtime.nproc_per_node=2"]
# The same rows and the same fp32 sums, reduced over two ranks by ZeRO instead of in one process.
RTOL = 1e-5


def _losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(str(run_dir))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """The run directory of RUN in one process (None) or under each ZeRO stage, each trained once."""
    from tests.conftest import cli

    root = tmp_path_factory.mktemp("deepspeed")

    @functools.cache
    def run(stage: int | None, offload: str = "none") -> str:
        run_dir = root / f"zero-{stage}-{offload}"
        extra = [] if stage is None else [*DEEPSPEED, f"strategy.zero_stage={stage}",
                                          f"strategy.offload_optimizer={offload}"]
        proc = cli(cache_dir, root, *RUN, *extra, f"hydra.run.dir={run_dir}", timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return str(run_dir)

    return run


# ZeRO-1, ZeRO-2 and ZeRO-Offload, and the resume, in CI's end-to-end step (each run is a minute, mostly the ranks'
# start); ZeRO-3, which partitions the most and which the export gathers, in `pytest`.
E2E = pytest.mark.e2e


@pytest.mark.parametrize(("stage", "offload"), [pytest.param(1, "none", marks=E2E), (3, "none"),
                                                pytest.param(2, "none", marks=E2E),
                                                pytest.param(2, "cpu", marks=E2E)])
@pytest.mark.e2e
def test_each_zero_stage_on_two_ranks_gives_one_process_losses(runs, stage, offload):
    run_dir, single = runs(stage, offload), runs(None)
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["strategy"] == "deepspeed" and summary["steps"] == STEPS
    assert summary["params"] == read_summary(single)["params"]  # counted whole, before ZeRO partitions them
    assert len(_losses(run_dir)) == STEPS
    assert _losses(run_dir) == pytest.approx(_losses(single), rel=RTOL)
    assert summary["final_eval_loss"] == pytest.approx(read_summary(single)["final_eval_loss"], rel=RTOL)
    files = os.listdir(os.path.join(run_dir, "checkpoints", f"step-{STEPS}"))
    assert {".manifest.json", "deepspeed.json"} <= set(files)
    assert sum(name.endswith("optim_states.pt") for name in files) == 2  # a partition per rank


@pytest.mark.e2e
def test_deepspeeds_own_checkpoint_resumes_to_the_same_next_losses(runs, run_cli, tmp_path):
    whole = runs(2)
    start = os.path.join(whole, "checkpoints", "step-10")
    proc = run_cli(*RUN, *DEEPSPEED, "strategy.zero_stage=2", f"train.resume={start}",
                   f"hydra.run.dir={tmp_path / 'resumed'}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(str(tmp_path / "resumed"))
    assert summary["resumed_from"] == start and summary["steps_this_run"] == STEPS - 10
    assert [m["step"] for m in read_metrics(str(tmp_path / "resumed"))] == list(range(11, STEPS + 1))
    assert _losses(tmp_path / "resumed") == pytest.approx(_losses(whole)[10:], rel=RTOL)
    verify = run_cli("verify", whole, module="trainer.checkpoint")  # the manifest of DeepSpeed's files
    assert verify.returncode == 0 and verify.stdout.count(": whole (") == 2, verify.stdout


@pytest.mark.e2e
def test_the_export_gathers_zero3_partitions_into_safetensors_transformers_loads(runs, run_cli, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for stage in (3, None):
        out[stage] = str(tmp_path / f"export-{stage}")
        proc = run_cli(os.path.join(runs(stage), "checkpoints", f"step-{STEPS}"), out[stage], module="trainer.export")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert os.path.isfile(os.path.join(out[stage], "model.safetensors"))
    zero3, single = (AutoModelForCausalLM.from_pretrained(out[s]).state_dict() for s in (3, None))
    assert zero3.keys() == single.keys()
    for name, tensor in single.items():
        torch.testing.assert_close(zero3[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def _without_deepspeed(tmp_path) -> dict:
    """An environment whose interpreter finds no deepspeed package (as where it is not installed)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize(("overrides", "line"), [
    (["strategy.zero_stage=4"], "error: invalid config: strategy.zero_stage=4: must be 1, 2 or 3 (ZeRO's stages: the "
                                "optimizer's state, the gradients too, the parameters too)"),
    (["runtime=mpi"], "error: invalid config: strategy='deepspeed': strategy.data_parallel=deepspeed runs under "
                      "runtime=deepspeed-distributed only (runtime is mpi): add runtime=deepspeed-distributed"),
    (["runtime=null"], "error: invalid config: strategy='deepspeed': strategy.data_parallel=deepspeed runs under "
                       "runtime=deepspeed-distributed only (runtime is null): add runtime=deepspeed-distributed"),
    (["strategy=ddp"], "error: invalid config: strategy='ddp': runtime=deepspeed-distributed runs "
                       "strategy.data_parallel=deepspeed only: add strategy=deepspeed"),
    (["strategy.offload_optimizer=nvme"], "error: invalid config: strategy.offload_optimizer='nvme': must be one of "
                                          "none, cpu"),
    (["train.checkpoint_async=true"], "error: invalid config: train.checkpoint_async=True: strategy=deepspeed saves "
                                      "with DeepSpeed's own save_checkpoint, which writes in the step: give false"),
    (["train.checkpoint_threads=4"], "error: invalid config: train.checkpoint_threads=4: strategy=deepspeed saves "
                                     "with DeepSpeed's own save_checkpoint, which writes its own files: give 1"),
    ([], "error: invalid config: runtime='deepspeed-distributed': runtime=deepspeed-distributed needs deepspeed, "
         "not installed here: install trainjob's deepspeed extra (DS_BUILD_OPS=0 pip install -e '.[deepspeed]')"),
    (["PATH=/nonexistent"], "error: invalid config: runtime='deepspeed-distributed': runtime=deepspeed-distributed "
                            "needs OpenMPI's mpirun, which is not on PATH: install the Debian package openmpi-bin "
                            "(apt-get install -y openmpi-bin, as root)"),
], ids=["zero-stage-4", "under-mpi", "no-runtime", "not-deepspeed", "offload-nvme", "async", "threads", "no-deepspeed",
        "no-mpirun"])
def test_what_deepspeed_cannot_run_is_one_line_exit_2_and_no_run_directory(run_cli, tmp_path, overrides, line):
    run_dir = tmp_path / "run"
    env = {"PATH": "/nonexistent"} if overrides == ["PATH=/nonexistent"] else {}
    if not overrides:
        env = _without_deepspeed(tmp_path)
    overrides = [o for o in overrides if not o.startswith("PATH=")]
    args = ["strategy=deepspeed"] if overrides == ["runtime=null"] else [*DEEPSPEED, *overrides]
    proc = run_cli(*TINY, *args, f"hydra.run.dir={run_dir}", env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == line
    assert not run_dir.exists()
