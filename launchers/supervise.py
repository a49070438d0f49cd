"""`python -m launchers.supervise <name>`: run one local job's command (from its registry record), copy
its output into the record's console log (and to this process's own stdout and stderr), and record its
exit code and end time, so that any process can tell how the job ended, and exit with it (a job killed by a
signal: 1). SIGTERM is passed on to the job; whatever the job started is gone before this process ends
(`trainjob.process_tree`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from launchers import registry
from trainjob import process_tree


def _copy(source, log, echo) -> None:
    for chunk in iter(lambda: source.read1(65536), b""):
        log.write(chunk)
        log.flush()
        try:
            echo.write(chunk)
            echo.flush()
        except (OSError, ValueError):  # nobody reads our own output any more: the log still gets it
            pass


def main(name: str) -> int:
    record = registry.load(name)
    if record is None:
        print(f"error: no local job {name!r} in {registry.jobs_dir()}", file=sys.stderr)
        return 2
    record.pid, record.pid_start = os.getpid(), registry.process_start(os.getpid())
    record.save()
    process_tree.adopt_orphans()
    try:
        code = _run(record)
    finally:
        process_tree.end_all()
    record = registry.load(name)  # as it is now: cancelled meanwhile, or deleted (then nothing to record)
    if record is not None:
        record.exit_code, record.ended = code, time.time()
        record.save()
    return code if code >= 0 else 1  # a signal (negative) is a failure; 2 and 143 say why


def _run(record: registry.JobRecord) -> int:
    """Run the job's command, its output copied; its exit code."""
    lock = threading.Lock()
    with open(record.console, "ab") as log:
        proc = subprocess.Popen(record.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))

        class Locked:
            def write(self, data):
                with lock:
                    log.write(data)

            def flush(self):
                with lock:
                    log.flush()

        threads = [
            threading.Thread(target=_copy, args=(proc.stdout, Locked(), sys.stdout.buffer)),
            threading.Thread(target=_copy, args=(proc.stderr, Locked(), sys.stderr.buffer)),
        ]
        for t in threads:
            t.start()
        code = proc.wait()
        process_tree.end_all()  # what it left (holding the pipes the threads read) first
        for t in threads:
            t.join()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
