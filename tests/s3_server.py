"""An S3 server on loopback for the storage tests: moto's own HTTP server (`moto[server]`), a real server that
answers S3's REST API over a socket, so that boto3, pyarrow's S3FileSystem, s3fs and the ranks of a torchrun job
all reach it as they would MinIO or AWS. It is started once per test session in a thread of the test process, on
a free loopback port; `s3` gives a test an empty bucket of its own and the environment that points clients at it.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest

from trainjob.nodes import LOCALHOST, free_port

# Credentials moto accepts; a test that checks refused credentials sets others.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "trainjob-test-key", "AWS_SECRET_ACCESS_KEY": "trainjob-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


@dataclass
class S3:
    """The server's endpoint, one empty bucket, and the environment for clients and subprocesses."""

    endpoint: str
    bucket: str
    env: dict[str, str]

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def upload_dir(self, local: str, prefix: str) -> str:
        """Upload every file under `local` to `s3://<bucket>/<prefix>/...`; returns that URL."""
        client = self.client()
        for root, _, files in os.walk(local):
            for name in files:
                path = os.path.join(root, name)
                client.upload_file(path, self.bucket, f"{prefix}/{os.path.relpath(path, local)}")
        return self.url(prefix)


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address=LOCALHOST, port=port, verbose=False)
    server.start()
    yield f"http://{LOCALHOST}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch) -> S3:
    """A fresh bucket on the loopback server; this process's environment points AWS clients at it (with
    `AWS_ENDPOINT_URL`, as for MinIO), and `S3.env` carries the same to subprocesses."""
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    store = S3(endpoint=s3_endpoint, bucket=f"b-{uuid.uuid4().hex[:12]}", env=env)
    store.client().create_bucket(Bucket=store.bucket)
    return store
