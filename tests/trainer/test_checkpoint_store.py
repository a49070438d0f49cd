"""Checkpoints in an object store (`train.checkpoint_dir=s3://...`), on moto's real S3 server on loopback
(tests/s3_server.py): two torchrun ranks write their DCP shards and the manifest there directly, in the background;
SIGTERM leaves a whole checkpoint there; a run in a new run directory with the same checkpoint_dir resumes from it
to the uninterrupted local run's losses, bit for bit, and prunes there; export and verify take the URL, and verify
names a changed object. Refused before launch (one line, exit 2, no run directory): a bucket that is not there, an
endpoint that does not answer. A store that stops answering mid-run fails that save in one line, exits non-zero,
and leaves the checkpoint before it whole and resumable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import DIST, TINY, read_metrics, read_summary
from tests.trainer.drivers import finish, keys, start, wait_for
from trainjob.nodes import LOCALHOST, free_port

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
ARGS = [*TINY, *DIST, "train.max_steps=30", "train.eval_every=30", "train.checkpoint_every=4",
        "train.keep_latest_k=2"]


@pytest.mark.e2e
def test_checkpoints_in_s3_resume_in_a_new_run_dir_export_and_verify(s3, cache_dir, tmp_path, run_cli):
    reference = tmp_path / "local"
    done = run_cli(*ARGS, f"hydra.run.dir={reference}")
    assert done.returncode == 0, done.stderr[-3000:]

    url = s3.url("ckpt/run1")
    args = [*ARGS, f"train.checkpoint_dir={url}"]
    first = start(cache_dir, tmp_path, s3.env, *args, "train.checkpoint_async=true", "train.checkpoint_threads=2",
                  f"hydra.run.dir={tmp_path / 'a'}")
    wait_for(lambda: "step-4/.manifest.json" in keys(s3, "ckpt/run1/"), first, "checkpoint step 4")
    first.send_signal(signal.SIGTERM)
    err = finish(first, 120)
    assert first.returncode == 143, err[-3000:]
    step = len(read_metrics(str(tmp_path / "a")))
    assert f"checkpoint of step {step} written to {url}/step-{step}" in err, err[-2000:]
    assert not (tmp_path / "a" / "checkpoints").exists()  # all of them went to the bucket
    assert set(keys(s3, f"ckpt/run1/step-{step}/")) == {  # two objects a rank: train.checkpoint_threads=2
        ".manifest.json", ".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"}

    second = start(cache_dir, tmp_path, s3.env, *args, f"hydra.run.dir={tmp_path / 'b'}")  # one object a rank
    err = finish(second)
    assert second.returncode == 0, err[-3000:]
    ours, ref = read_metrics(str(tmp_path / "b")), read_metrics(str(reference))
    assert ours[0]["step"] == step + 1
    assert [m["loss"] for m in ours] == [m["loss"] for m in ref[step:]]
    assert read_summary(str(tmp_path / "b"))["final_eval_loss"] == read_summary(str(reference))["final_eval_loss"]
    kept = sorted({k.split("/")[0] for k in keys(s3, "ckpt/run1/") if k.startswith("step-")})
    assert kept == ["step-28", "step-30"]  # keep_latest_k=2, pruned in the bucket

    out = tmp_path / "exported"
    export = run_cli(f"{url}/step-30", str(out), module="trainer.export", env=s3.env)
    assert export.returncode == 0, export.stderr[-3000:]
    local = run_cli(str(reference / "checkpoints" / "step-30"), str(tmp_path / "exported-local"),
                    module="trainer.export")
    assert local.returncode == 0, local.stderr[-3000:]
    ours, theirs = load_file(out / "model.safetensors"), load_file(tmp_path / "exported-local" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    whole = run_cli("verify", url, module="trainer.checkpoint", env=s3.env)
    assert whole.returncode == 0 and [line.split(" (")[0] for line in whole.stdout.splitlines()] == [
        "step 28: whole", "step 30: whole"], whole.stdout + whole.stderr
    key = "ckpt/run1/step-30/__1_0.distcp"
    body = bytearray(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    changed = run_cli("verify", url, module="trainer.checkpoint", env=s3.env)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert changed.stdout.splitlines()[1].startswith(
        "step 30: damaged: its file __1_0.distcp does not hold the bytes written"), changed.stdout


@pytest.mark.e2e
def test_a_store_that_cannot_be_used_is_refused_before_launch(s3, run_cli, tmp_path):
    quiet = {**s3.env, "AWS_ENDPOINT_URL": f"http://{LOCALHOST}:{free_port()}"}  # nothing listens there
    for env, url, said in ((s3.env, "s3://no-such-bucket-here/ckpt", "no such bucket or object"),
                           (quiet, s3.url("ckpt"), "the endpoint does not answer")):
        run_dir = tmp_path / "run"
        proc = run_cli(*TINY, "train.max_steps=2", f"train.checkpoint_dir={url}", "train.checkpoint_retries=0",
                       f"hydra.run.dir={run_dir}", env=env)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"error: invalid config: train.checkpoint_dir='{url}': {said}"), proc.stderr
        assert not run_dir.exists()


@pytest.mark.e2e
def test_a_store_that_stops_answering_fails_that_save_and_leaves_the_last_whole(s3, cache_dir, tmp_path):
    from moto.server import ThreadedMotoServer

    port = free_port()  # a server of this test's own, sharing the session server's buckets (moto's state)
    server = ThreadedMotoServer(ip_address=LOCALHOST, port=port, verbose=False)
    server.start()
    url = s3.url("ckpt/outage")
    env = {**s3.env, "AWS_ENDPOINT_URL": f"http://{LOCALHOST}:{port}"}
    args = [*ARGS, "train.max_steps=400", "train.checkpoint_every=2", f"train.checkpoint_dir={url}",
            "train.checkpoint_retries=1"]
    try:
        proc = start(cache_dir, tmp_path, env, *args, f"hydra.run.dir={tmp_path / 'a'}")
        wait_for(lambda: "step-2/.manifest.json" in keys(s3, "ckpt/outage/"), proc, "checkpoint step 2")
    finally:
        server.stop()
    err = finish(proc, 180)
    assert proc.returncode == 1, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("error: checkpoint step ")]
    assert len(said) == 1 and f"could not be written to {url}/step-" in said[0], err[-3000:]
    assert "the checkpoints before it in" in said[0] and "are whole" in said[0]
    failed = int(said[0].split("error: checkpoint step ")[1].split()[0])
    last = failed - 2
    assert last >= 2

    # A writer that died half way: every object of a checkpoint but its manifest, written last.
    client, half = s3.client(), last + 100
    for name in keys(s3, f"ckpt/outage/step-{last}/"):
        if name != ".manifest.json":
            client.copy_object(Bucket=s3.bucket, Key=f"ckpt/outage/step-{half}/{name}",
                               CopySource={"Bucket": s3.bucket, "Key": f"ckpt/outage/step-{last}/{name}"})
    verify = subprocess.run([sys.executable, "-m", "trainer.checkpoint", "verify", url],
                            env={**os.environ, **s3.env}, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    said = {line.split(":")[0]: line for line in verify.stdout.splitlines()}
    assert said[f"step {last}"].startswith(f"step {last}: whole"), verify.stdout
    assert said[f"step {half}"].startswith(
        f"step {half}: damaged: its .manifest.json is missing: its writer did not finish"), verify.stdout
    assert not said.get(f"step {failed}", "damaged").startswith(f"step {failed}: whole")
    # The last whole one resumes, in one process where two wrote it (DCP reshards), passing the half-written one.
    again = start(cache_dir, tmp_path, s3.env, *TINY, f"train.max_steps={last + 2}", "train.eval_every=30",
                   "train.checkpoint_every=2", f"train.checkpoint_dir={url}", f"hydra.run.dir={tmp_path / 'b'}")
    err = finish(again)
    assert again.returncode == 0, err[-3000:]
    assert [m["step"] for m in read_metrics(str(tmp_path / "b"))] == [last + 1, last + 2]


def test_a_fresh_run_over_a_buckets_checkpoints_is_refused_by_the_driver_alone(s3, tmp_path):
    """Before launch the driver refuses train.resume=never where the URL already holds checkpoints; a restart's
    ranks (`agreed`, which calls `decide`) go on, and `reach` only asks the store."""
    from types import SimpleNamespace

    from trainer.checkpoint import resume
    from trainer.errors import ConfigError

    url = s3.url("ckpt/run1")
    train = SimpleNamespace(checkpoint_dir=url, checkpoint_retries=0, resume="never")
    cfg = SimpleNamespace(train=train, run_dir=str(tmp_path / "run"))
    resume.reach(cfg)
    assert resume.decide_at_launch(cfg) is None  # nothing there yet
    s3.client().put_object(Bucket=s3.bucket, Key="ckpt/run1/step-2/.manifest.json", Body=b"{}")
    with pytest.raises(ConfigError, match="already holds checkpoints that a fresh run would overwrite"):
        resume.decide_at_launch(cfg)
    assert resume.decide(cfg) is None  # a restart of this run starts again over its own
    train.resume = "auto"
    resume.decide_at_launch(cfg)
