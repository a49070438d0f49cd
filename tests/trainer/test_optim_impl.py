"""`optim.impl=torch|triton`: ops.AdamW (Triton, under the interpreter here) trains as torch.optim.AdamW does,
a checkpoint written under either resumes under the other to the same next losses, and under FSDP2 (DTensor
parameters, stepped by their local shards) it gives the DDP reference's losses."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.conftest import DIST, REFERENCE, TINY, read_metrics

ENV = {"TRITON_INTERPRET": "1"}
# Checkpoint at step 2; steps 3 and 4 take the optimizer's state from it (step 3's update sets step 4's loss).
ARGS = [*TINY, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=100", "train.eval_batches=1"]


def _losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(str(run_dir))}


def _both(run_cli, runs: dict[str, list[str]]) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        done = {name: pool.submit(run_cli, *args, env=ENV) for name, args in runs.items()}
    for name, proc in done.items():
        assert proc.result().returncode == 0, f"{name}: {proc.result().stderr[-3000:]}"


@pytest.mark.e2e
def test_a_checkpoint_resumes_under_the_other_optimizer(run_cli, tmp_path):
    _both(run_cli, {impl: [*ARGS, f"optim.impl={impl}", f"hydra.run.dir={tmp_path / impl}"]
                    for impl in ("triton", "torch")})
    first = {impl: _losses(tmp_path / impl) for impl in ("triton", "torch")}
    assert list(first["triton"]) == [1, 2, 3, 4]
    assert first["triton"] == pytest.approx(first["torch"], rel=1e-5)  # the same arithmetic
    other = {"triton": "torch", "torch": "triton"}
    _both(run_cli, {f"{impl}-to-{other[impl]}": [
        *ARGS, f"optim.impl={other[impl]}", f"train.resume={tmp_path / impl / 'checkpoints' / 'step-2'}",
        f"hydra.run.dir={tmp_path / f'{impl}-to-{other[impl]}'}"] for impl in ("triton", "torch")})
    for impl in ("triton", "torch"):
        resumed = _losses(tmp_path / f"{impl}-to-{other[impl]}")
        assert list(resumed) == [3, 4]
        # Step 4's loss follows step 3's update, which used the moments and step count loaded from step 2.
        assert resumed == pytest.approx({s: first[impl][s] for s in (3, 4)}, rel=1e-5), impl


@pytest.mark.slow
@pytest.mark.e2e
def test_fsdp2_with_our_adamw_gives_the_ddp_reference_losses(run_cli, tmp_path, ddp_reference):
    proc = run_cli(*REFERENCE, *DIST, "strategy=fsdp2", "optim.impl=triton", f"hydra.run.dir={tmp_path / 'run'}",
                   env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, reference = _losses(tmp_path / "run"), _losses(ddp_reference)
    assert len(ours) == 6 and ours == pytest.approx(reference, rel=1e-4)
