"""Training progress for Kubeflow Trainer's `TrainJob.status.trainerStatus` (v2.2+, the TrainJobStatus
feature gate): when the controller gives the pod KUBEFLOW_TRAINER_SERVER_URL (with the paths of a CA
certificate and a service-account token), rank 0 reports progress, estimated time remaining and metrics
as the Kubeflow SDK's `update_trainjob_status` does: a POST of `{"trainerStatus": {...}}` with the token
as a bearer credential, at most every 5 seconds.

Reports go from a background thread: training hands over its latest numbers and never waits, so an
endpoint that is slow or down costs nothing but a warning in the log.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.request
from datetime import datetime, timezone

log = logging.getLogger(__name__)

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
INTERVAL_S = 5.0  # the SDK's throttle
MAX_METRICS = 256  # the CRD's maxItems
MAX_VALUE = 64  # the CRD's maxLength of a metric's name and value


def status(step: int, total: int, seconds: float, metrics: dict[str, float], first: int = 0) -> dict:
    """The `trainerStatus` for `step` of `total` steps, `seconds` after this attempt began at step `first`."""
    body: dict = {"lastUpdatedTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "progressPercentage": max(0, min(100, int(100 * step / max(total, 1))))}
    if step > first and seconds > 0:
        rate = seconds / (step - first)
        body["estimatedRemainingSeconds"] = min(2**31 - 1, max(0, round(rate * (total - step))))
    items = [{"name": str(k)[:MAX_VALUE], "value": f"{v:.6g}"[:MAX_VALUE]}
             for k, v in metrics.items() if v is not None][:MAX_METRICS]
    if items:
        body["metrics"] = items
    return body


class ProgressReporter:
    """Sends the latest progress to the Trainer controller from a thread of its own."""

    def __init__(self, url: str, ca_file: str | None, token_file: str | None, total_steps: int,
                 first_step: int = 0, interval: float = INTERVAL_S):
        self.url, self.token_file, self.total, self.interval = url, token_file, total_steps, interval
        self.first = first_step
        self.context = ssl.create_default_context(cafile=ca_file) if url.startswith("https") else None
        self._latest: tuple[int, dict] | None = None
        self._sent: tuple[int, dict] | None = None
        self._start = time.monotonic()
        self._wake = threading.Condition()
        self._closing = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="trainjob-progress", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, total_steps: int, first_step: int = 0) -> ProgressReporter | None:
        """A reporter when the TrainJob asks for one (its variables are set), for an attempt that starts
        (or resumes) at `first_step`."""
        url = os.environ.get(URL_ENV)
        if not url:
            return None
        return cls(url, os.environ.get(CA_ENV), os.environ.get(TOKEN_ENV), total_steps, first_step)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Hand over the latest numbers (returns at once)."""
        with self._wake:
            self._latest = (step, dict(metrics))
            self._wake.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Send what is pending, then stop (waiting at most `timeout` seconds for a slow endpoint)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        last = -float("inf")
        while True:
            with self._wake:
                while not self._closing and (self._latest is self._sent
                                             or time.monotonic() - last < self.interval):
                    wait = None if self._latest is self._sent else self.interval - (time.monotonic() - last)
                    self._wake.wait(wait)
                latest, closing = self._latest, self._closing
            if latest is not None and latest is not self._sent:
                self._send(*latest)
                self._sent, last = latest, time.monotonic()
            if closing:
                return

    def _send(self, step: int, metrics: dict[str, float]) -> None:
        seconds = time.monotonic() - self._start
        body = json.dumps({"trainerStatus": status(step, self.total, seconds, metrics, self.first)})
        headers = {"Content-Type": "application/json"}
        try:
            if self.token_file:
                with open(self.token_file) as f:  # a projected token is rotated: read it each time
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            request = urllib.request.Request(self.url, data=body.encode(), headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=5, context=self.context) as response:
                response.read()
        except Exception as e:  # never a reason to stop training: say so once
            if not self._warned:
                log.warning("progress report to %s failed (%s: %s); training goes on", self.url,
                            type(e).__name__, e)
                self._warned = True
