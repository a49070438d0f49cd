"""`StorageError`: a URL that cannot be read or written (no such bucket, object or repo, credentials refused, an
endpoint that does not answer, a filesystem library not installed). It is an `OptionError`, so the trainer reports
it as its config error: one line naming the key, the URL and the real cause, exit 2, before any work starts."""

from __future__ import annotations

from trainjob.options import OptionError


class StorageError(OptionError):
    """`key`=`url` cannot be used; `reason` says why and what to do."""
