"""Progress on the TrainJob (`status.trainerStatus`): rank 0 reports to a local HTTPS server that plays
Kubeflow Trainer's status endpoint (a self-signed CA made with openssl, a bearer token from a file) and
checks every payload against the trainerStatus schema of the real TrainJob CRD."""

from __future__ import annotations

import itertools
import json
import os
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jsonschema
import pytest
import yaml

from tests.conftest import TINY
from tests.launchers import crds
from trainer.observability import trainer_status


def _trainer_status_schema() -> dict:
    with open(os.path.join(crds.crd_dir(), crds.FILES["TrainJob"])) as f:
        crd = yaml.safe_load(f)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "trainerStatus"]


class StatusServer:
    """HTTPS on loopback: validates each POST (bearer token, schema) and keeps the trainerStatus bodies."""

    def __init__(self, tmp_path, delay: float = 0.0):
        self.ca = str(tmp_path / "ca.pem")
        key = str(tmp_path / "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", self.ca,
                        "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        self.token = str(tmp_path / "token")
        with open(self.token, "w") as f:
            f.write("projected-token\n")
        self.received: list[dict] = []
        self.errors: list[str] = []
        schema, server = _trainer_status_schema(), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    assert self.headers["Authorization"] == "Bearer projected-token", self.headers["Authorization"]
                    assert set(body) == {"trainerStatus"}, body
                    jsonschema.validate(body["trainerStatus"], schema)
                    assert "lastUpdatedTime" in body["trainerStatus"]
                    server.received.append({"at": time.monotonic(), **body["trainerStatus"]})
                except (AssertionError, jsonschema.ValidationError) as e:
                    server.errors.append(str(e))
                time.sleep(delay)
                self.send_response(200)
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}/status"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        return {trainer_status.URL_ENV: self.url, trainer_status.CA_ENV: self.ca, trainer_status.TOKEN_ENV: self.token}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def status_server(tmp_path):
    server = StatusServer(tmp_path)
    yield server
    server.close()


def test_reports_are_throttled_valid_and_end_with_the_last_state(status_server):
    interval = 1.0  # the real one is 5 s; the rule is the same
    reporter = trainer_status.ProgressReporter(status_server.url, status_server.ca, status_server.token,
                                               total_steps=100, first_step=50, interval=interval)
    step, end = 50, time.monotonic() + 2.5
    while time.monotonic() < end:  # updates far more often than the interval, for 2.5 s however busy the CPU
        step = min(step + 1, 99)
        reporter.update(step, {"loss": 5.0 - step / 50, "eval_loss": None, "tokens_per_s": 1234.5})
        time.sleep(0.01)
    reporter.update(100, {"loss": 3.0, "tokens_per_s": 1234.5})
    reporter.close()
    assert status_server.errors == []
    got = status_server.received
    assert 2 <= len(got) <= 5  # the first at once, one per interval, the last on close
    # Every report but the closing one waits out the interval after the one before.
    assert all(b["at"] - a["at"] >= interval - 0.1 for a, b in itertools.pairwise(got[:-1]))
    last = got[-1]
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    assert {m["name"]: m["value"] for m in last["metrics"]} == {"loss": "3", "tokens_per_s": "1234.5"}
    # Resumed at step 50: the time left comes from this attempt's own pace (steps since 50).
    assert trainer_status.status(60, 100, 10.0, {}, first=50)["estimatedRemainingSeconds"] == 40


def test_a_slow_or_absent_endpoint_never_holds_training(tmp_path):
    slow = StatusServer(tmp_path, delay=3.0)
    try:
        reporter = trainer_status.ProgressReporter(slow.url, slow.ca, slow.token, total_steps=10)
        start = time.monotonic()
        for step in range(1, 11):
            reporter.update(step, {"loss": 1.0})
        assert time.monotonic() - start < 0.5
        reporter.close(timeout=0.5)
        assert time.monotonic() - start < 2.0
    finally:
        slow.close()
    down = trainer_status.ProgressReporter("https://127.0.0.1:1/status", None, None, total_steps=10)
    down.update(1, {"loss": 1.0})
    down.close()  # logs a warning, raises nothing


@pytest.mark.e2e
def test_a_run_reports_its_progress_when_the_trainjob_asks(run_cli, tmp_path, status_server):
    proc = run_cli(*TINY, "train.max_steps=6", "train.eval_every=3", f"hydra.run.dir={tmp_path / 'run'}",
                   env=status_server.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert status_server.errors == []
    last = status_server.received[-1]
    assert last["progressPercentage"] == 100
    assert {"loss", "eval_loss", "tokens_per_s", "lr", "grad_norm"} <= {m["name"] for m in last["metrics"]}
