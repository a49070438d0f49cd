"""A checkpoint proves itself: its manifest holds each file's size and XXH3-128 hash (two ranks, saving in the
background), `python -m trainer.checkpoint verify` names what is not as written, export refuses it in one line
with exit 2 and writes nothing, and a resume passes over damaged checkpoints (set aside, never deleted) to the
newest whole one and ends at the uninterrupted run's losses. A checkpoint without a manifest (written before
them) still exports, with a notice. Real runs: torchrun's agent and two ranks on gloo."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import DIST, TINY, read_metrics, read_summary
from trainer.checkpoint.manifest import HASH, MANIFEST, file_hash

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
ARGS = [
    *TINY,
    *DIST,
    "train.max_steps=8",
    "train.checkpoint_every=2",
    "train.keep_latest_k=4",
    "train.checkpoint_async=true",
    "train.eval_every=4",
]


def _flip_bytes(path) -> None:
    """Change bytes in the middle of `path`, its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(8)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


@pytest.mark.e2e
def test_damaged_checkpoints_are_named_refused_and_passed_over(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    first = run_cli(*ARGS, f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    uninterrupted, losses = read_summary(str(run_dir)), [m["loss"] for m in read_metrics(str(run_dir))]
    manifest = json.loads((ckpts / "step-8" / MANIFEST).read_text())
    assert manifest["hash"] == HASH and sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for name, entry in manifest["files"].items():
        assert file_hash(ckpts / "step-8" / name) == (entry["size"], entry[HASH])
    whole = run_cli("verify", str(run_dir), module="trainer.checkpoint")
    assert whole.returncode == 0 and [line.split(":")[:2] for line in whole.stdout.splitlines()] == [
        [f"step {s}", " whole (" + str(ckpts / f"step-{s}") + ")"] for s in (2, 4, 6, 8)
    ], whole.stdout

    _flip_bytes(ckpts / "step-8" / "__1_0.distcp")
    _truncate(ckpts / "step-6" / "__0_0.distcp")
    verify = run_cli("verify", str(run_dir), module="trainer.checkpoint")
    assert verify.returncode == 1, verify.stdout + verify.stderr
    lines = verify.stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith("step 2: whole") and lines[1].startswith("step 4: whole")
    assert lines[2].startswith("step 6: damaged: its file __0_0.distcp is ") and "bytes, " in lines[2], lines[2]
    assert lines[3].startswith("step 8: damaged: its file __1_0.distcp does not hold the bytes written"), lines[3]
    assert f"{HASH} hash differs" in lines[3]
    single = run_cli("verify", str(ckpts / "step-8"), module="trainer.checkpoint")
    assert single.returncode == 1 and single.stdout.splitlines() == [lines[3]]

    for step, what in ((8, "its file __1_0.distcp does not hold the bytes written"), (6, "its file __0_0.distcp is")):
        before = sorted(os.listdir(tmp_path))
        export = run_cli(str(ckpts / f"step-{step}"), str(tmp_path / "out"), module="trainer.export")
        assert export.returncode == 2 and len(export.stderr.splitlines()) == 1, export.stderr
        assert export.stderr.startswith("error: invalid config: CHECKPOINT=") and what in export.stderr, export.stderr
        assert sorted(os.listdir(tmp_path)) == before  # nothing written

    resumed = run_cli(*ARGS, f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    aside = [name for name in os.listdir(ckpts) if name.startswith("damaged-")]
    assert len(aside) == 1 and sorted(os.listdir(ckpts / aside[0])) == ["step-6", "step-8"]
    assert os.path.getsize(ckpts / aside[0] / "step-8" / "__1_0.distcp") > 0  # kept, never deleted
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"checkpoint {ckpts / 'step-8'} is damaged (its file __1_0.distcp does not hold" in log
    assert f"checkpoint {ckpts / 'step-6'} is damaged (its file __0_0.distcp is" in log
    summary = read_summary(str(run_dir))
    assert summary["resumed_from"] == str(ckpts / "step-4") and summary["steps_this_run"] == 4
    assert (summary["final_train_loss"], summary["final_eval_loss"]) == (
        uninterrupted["final_train_loss"],
        uninterrupted["final_eval_loss"],
    )
    assert [m["loss"] for m in read_metrics(str(run_dir))] == losses
    again = run_cli("verify", str(run_dir), module="trainer.checkpoint")
    assert again.returncode == 0 and len(again.stdout.splitlines()) == 4, again.stdout


@pytest.mark.e2e
def test_a_checkpoint_without_manifest_exports_with_a_notice(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(*TINY, "train.max_steps=2", "train.checkpoint_every=2", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    step = run_dir / "checkpoints" / "step-2"
    os.remove(step / MANIFEST)
    verify = run_cli("verify", str(step), module="trainer.checkpoint")
    assert verify.returncode == 0 and "no manifest" in verify.stdout, verify.stdout
    export = run_cli(str(step), str(tmp_path / "out"), module="trainer.export")
    assert export.returncode == 0, export.stderr
    notices = [line for line in export.stderr.splitlines() if "cannot be verified" in line]
    assert len(notices) == 1 and str(step) in notices[0], export.stderr
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")


def test_verify_of_a_path_without_checkpoints_exits_2(run_cli, tmp_path):
    proc = run_cli("verify", str(tmp_path), module="trainer.checkpoint")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {tmp_path} is neither a checkpoint nor a run directory with checkpoints"
    )
