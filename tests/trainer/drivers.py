"""A `python -m trainer` driver started in the background, for tests that signal it or watch a store while it runs
(tests/trainer/test_checkpoint_store.py, test_storage_runs.py): `start` it, `wait_for` what it writes, `finish` it;
`keys` lists a bucket's objects under a prefix (moto's S3 server, tests/s3_server.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def start(cache_dir: str, cwd, env: dict, *args: str) -> subprocess.Popen:
    """`python -m trainer *args`, its output to a file (a pipe nobody reads while it runs would fill and stop it)."""
    full = {**os.environ, **env, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    out = open(os.path.join(cwd, f"driver-{time.monotonic_ns()}.out"), "w+")  # noqa: SIM115 - read by finish
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=str(cwd), env=full, text=True,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc.output = out
    return proc


def keys(s3, prefix: str) -> list[str]:
    """The bucket's keys under `prefix`, less the prefix, sorted."""
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for o in listed.get("Contents", []))


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    """Until `condition()` holds; AssertionError with the driver's output if it ends or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} never came: exit {proc.poll()} {finish(proc, 1)[-3000:]}")


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Wait for `proc` (killed, with its group, after `timeout` seconds); its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.output.seek(0)
    text = proc.output.read()
    proc.output.close()
    return text
