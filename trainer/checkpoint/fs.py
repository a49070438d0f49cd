"""Where checkpoints are kept: a local directory, or an object store's URL (`s3://bucket/prefix`, `gs://...`:
`train.checkpoint_dir`), through one set of calls (`isfile`, `listdir`, `open`, `rmtree`, `rename`, ...) that the
checkpoint modules use for every file they touch. Local paths go to `os` and `shutil` as they always did; URLs to
their fsspec filesystem (s3fs reads AWS's environment variables, `~/.aws` and `AWS_ENDPOINT_URL`), made without a
listing cache, since the other ranks write the same prefix, and with `retries` bounded attempts per request
(`train.checkpoint_retries`, set once per process by `configure`); `trainjob.storage.objects` makes them.

An object store renames nothing atomically: there a checkpoint is written in place, and is whole once its manifest,
written last, is there (`trainer.checkpoint.layout`)."""

from __future__ import annotations

import os
import shutil
import uuid

from trainjob.storage import objects
from trainjob.storage.urls import is_url

_settings = {"retries": 3}


def configure(retries: int) -> None:
    """This process's bound on the attempts of each request to an object store beyond the first (transient
    errors: a connection refused or reset, a timeout, a throttled or failed request)."""
    _settings["retries"] = int(retries)


def retries() -> int:
    return _settings["retries"]


def remote(path: str) -> bool:
    """Whether `path` is an object store's URL rather than a local path."""
    return is_url(path)


def filesystem(path: str):
    """The fsspec filesystem of URL `path` (one per process and settings: fsspec keeps the instance)."""
    return objects.fsspec_filesystem("train.checkpoint_dir", path, retries=_settings["retries"], cached=True)


def isfile(path: str) -> bool:
    return filesystem(path).isfile(path) if remote(path) else os.path.isfile(path)


def isdir(path: str) -> bool:
    return filesystem(path).isdir(path) if remote(path) else os.path.isdir(path)


def listdir(path: str) -> list[str]:
    """The names directly in `path` (none where there is no such directory)."""
    if not remote(path):
        return os.listdir(path) if os.path.isdir(path) else []
    try:
        entries = filesystem(path).ls(path, detail=False)
    except FileNotFoundError:
        return []
    return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]


def getsize(path: str) -> int:
    return filesystem(path).size(path) if remote(path) else os.path.getsize(path)


def open(path: str, mode: str = "rb"):  # the checkpoint modules' one way to open a file
    import builtins

    return filesystem(path).open(path, mode) if remote(path) else builtins.open(path, mode)


def makedirs(path: str) -> None:
    """Make directory `path` (nothing to make in an object store: a prefix exists once it holds an object)."""
    if not remote(path):
        os.makedirs(path, exist_ok=True)


def rmtree(path: str) -> None:
    """Remove directory `path` and all it holds, if it exists."""
    if not remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    store = filesystem(path)
    if store.exists(path):
        store.rm(path, recursive=True)


def remove(path: str) -> None:
    filesystem(path).rm(path) if remote(path) else os.remove(path)


def rename(path: str, new: str) -> None:
    """Move `path` (a file or directory) to `new`: one rename locally, a copy and delete of each object in a
    store (never relied on to be atomic there)."""
    if remote(path):
        store = filesystem(path)
        old = store._strip_protocol(path)
        for name in store.find(path):  # every object under the prefix (or the one object)
            store.copy(name, new + name[len(old):])
        store.rm(path, recursive=True)
    else:
        os.rename(path, new)


def unique_dir(root: str, prefix: str) -> str:
    """A new directory in `root` whose name starts with `prefix`."""
    if not remote(root):
        import tempfile

        return tempfile.mkdtemp(prefix=prefix, dir=root)
    return os.path.join(root, prefix + uuid.uuid4().hex[:8])


def real(path: str) -> str:
    """`path` with links resolved (a URL as it is)."""
    return path if remote(path) else os.path.realpath(path)


def stamp(path: str) -> tuple | None:
    """What tells whether file `path` changed: its size, mtime and inode; an object's size and ETag. None when it
    is not there."""
    try:
        if remote(path):
            info = filesystem(path).info(path)
            return info.get("size"), info.get("ETag") or info.get("etag") or info.get("md5Hash")
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns, st.st_ino
    except (OSError, FileNotFoundError):
        return None
