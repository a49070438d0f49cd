"""Storage credentials on `launcher=docker` (launchers/docker/credentials.py): AWS's and the Hub's variables in the
driver's environment reach every container at run time as `--env NAME`, valued from the docker CLI's environment;
no value is on a command line or in any file of the run directory; credential files are mounted read-only. The
driver runs for real (`python -m trainer`, its checks asking moto's S3 server for the checkpoints' bucket) against
`fake_docker.py`, a test double of the docker CLI (no Docker engine runs here)."""

from __future__ import annotations

import os

import pytest

from launchers.docker import credentials
from tests.conftest import TINY
from tests.launchers.test_docker import docker  # noqa: F401 - the fixture: fake docker CLI on PATH

SECRETS = {"AWS_SECRET_ACCESS_KEY": "trainjob-test-secret", "HF_TOKEN": "hf_trainjobTESTtoken0123456789"}


@pytest.mark.e2e
def test_credentials_reach_the_containers_as_environment_and_no_file_of_the_run(s3, docker, run_cli,  # noqa: F811
                                                                                tmp_path, monkeypatch):
    _, _, calls = docker
    monkeypatch.setenv("HF_TOKEN", SECRETS["HF_TOKEN"])
    run_dir = tmp_path / "run"
    proc = run_cli(*TINY, "launcher=docker", "+runtime=torch-distributed", "runtime.nnodes=2", "train.max_steps=2",
                   f"train.checkpoint_dir={s3.url('ckpt')}", f"hydra.run.dir={run_dir}",
                   env={**s3.env, "HF_TOKEN": SECRETS["HF_TOKEN"]})
    runs = [c for c in calls() if c["argv"][0] == "run"]
    assert proc.returncode == 0 and len(runs) == 2, proc.stderr[-3000:]
    for call in runs:
        argv = call["argv"]
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "HF_TOKEN"):
            assert argv[argv.index(name) - 1] == "--env", argv  # named, its value from the CLI's environment
        assert call["credentials"]["AWS_SECRET_ACCESS_KEY"] == SECRETS["AWS_SECRET_ACCESS_KEY"]
        assert call["credentials"]["HF_TOKEN"] == SECRETS["HF_TOKEN"]
    for call in calls():
        assert not any(value in " ".join(call["argv"]) for value in SECRETS.values()), call["argv"]
    written = [os.path.join(d, n) for d, _, names in os.walk(run_dir) for n in names]
    assert any(p.endswith("config.yaml") for p in written), written
    for path in written:
        with open(path, "rb") as f:
            data = f.read()
        assert not any(value.encode() in data for value in SECRETS.values()), path


def test_credential_files_are_mounted_read_only_where_their_variables_point(tmp_path):
    key = tmp_path / "gcp.json"
    key.write_text("{}")
    found = credentials.of_environment({"GOOGLE_APPLICATION_CREDENTIALS": str(key), "AWS_REGION": "eu-west-1",
                                        "UNRELATED": "x"})
    assert found["GOOGLE_APPLICATION_CREDENTIALS"] == str(key) and found["AWS_REGION"] == "eu-west-1"
    assert "UNRELATED" not in found
    assert credentials.mounts(found) == ["--volume", f"{key}:{key}:ro"]
