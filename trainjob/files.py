"""Whether a directory can be made and written at a path: the check every CLI runs on a path it will write
(a run directory, the job registry, a cache directory) before it writes anything, so that a file where a
folder belongs or a read-only mount is one line naming the key, not an OSError midway."""

from __future__ import annotations

import os
import tempfile


def nearest_existing(path: str) -> str:
    """`path` itself when it exists, else its nearest ancestor that does."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def directory_problem(path: str) -> str | None:
    """What stops `path` from being, or becoming, a directory this process writes in (a phrase such as
    "is a file"), or None. Writability is tried, not read from the mode bits: root ignores those, and a
    read-only mount or /sys refuses even root. The trial leaves nothing behind."""
    path = os.path.abspath(os.path.expanduser(path))
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        return "is a file" if existing == path else f"is inside {existing}, which is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".trainjob-probe-", dir=existing))
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if existing == path:
            return f"is not writable ({reason})"
        return f"cannot be made: {existing} is not writable ({reason})"
    return None


def write_whole(path: str, text: str, mode: int = 0o644) -> None:
    """Write `path` whole or not at all: through `<path>.tmp`, renamed when complete; the temporary file is
    removed when the write fails (a full disk), so nothing half-written stays either way."""
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
