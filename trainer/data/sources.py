"""`data.path` as files on this disk: a path is itself; a URL (`s3://b/corpus/*.parquet`,
`hf://datasets/<org>/<name>/<glob>`) is fetched once into the storage cache (`trainjob.storage.fetch`: keyed by
the objects' versions, so an unchanged source is not copied again) and read from there while its corpus is built.
`identity` is what a corpus's fingerprint records of each file: a fetched object's URL, size and version (its ETag,
or the Hub's commit), a local file's path, size and time."""

from __future__ import annotations

import os

from trainer.config.runtime import config_errors
from trainjob.storage import fetch


def local(d) -> str | None:
    """The local path that stands for `d.path` (a DataConfig's): itself, or the glob over its fetched copy."""
    with config_errors():
        return fetch.local("data.path", d.path, fetch.root(d.cache_dir))


def identity(file: str) -> tuple:
    """(where, size, version) of a source file, for the corpus's fingerprint."""
    return fetch.origin(file) or (os.path.abspath(file), os.path.getsize(file), os.path.getmtime(file))
