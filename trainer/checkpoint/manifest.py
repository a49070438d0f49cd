"""What a checkpoint's files must hold: each checkpoint's manifest (`.manifest.json`), and its verification.

Every rank writes its DCP files through `HashingWriter`, which hashes the bytes as they go to disk (xxHash's
XXH3-128, at memory speed, rather than reading the files again) and notes each file's size; once its files are
closed, the rank leaves its part of the manifest beside them (`.manifest.rank<r>.json`), and rank 0, after
every rank is done, merges the parts, adds the `.metadata` DCP wrote, and writes `.manifest.json` last, before
the checkpoint is renamed whole (DeepSpeed's writer records nothing: its files are hashed from disk once written,
`write_manifest_of_all`). `problem` compares a checkpoint's files with its manifest before anything
loads it: a missing file, another size, other bytes of the same size (a flipped bit, a copy gone wrong).
Checkpoints written before there were manifests load with a one-line notice that they cannot be verified.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from contextlib import contextmanager

import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from trainer.checkpoint import fs
from trainer.checkpoint.layout import MANIFEST

log = logging.getLogger(__name__)
# Whether saves write a manifest of their files' sizes and hashes; bench/checkpoint.py turns it off to measure what
# hashing adds to a save.
HASH_FILES = True
HASH = "xxh3_128"
CHUNK = 8 << 20
_PART = ".manifest.rank{}.json"
_noticed: set[str] = set()
_verified: dict[str, tuple] = {}  # directory -> its files' state when last found whole (`_state`)


def file_hash(path: str) -> tuple[int, str]:
    """(size, hash) of the file `path`, read in chunks."""
    h, size = xxhash.xxh3_128(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


class _HashingStream:
    """A file being written that hashes what goes through it. A seek makes the running hash meaningless: the
    file is then hashed again from disk once closed."""

    def __init__(self, raw, path: str, record):
        self.raw, self.path, self.record = raw, path, record
        self.hash, self.size, self.sequential = xxhash.xxh3_128(), 0, True

    def write(self, data) -> int:
        self.hash.update(data)
        n = self.raw.write(data)
        self.size += n
        return n

    def seek(self, *args) -> int:
        self.sequential = False
        return self.raw.seek(*args)

    def close(self) -> None:
        if not self.raw.closed:
            self.raw.close()  # an object store's upload completes here
            whole = self.sequential and fs.getsize(self.path) == self.size
            self.record(
                os.path.basename(self.path), *((self.size, self.hash.hexdigest()) if whole else file_hash(self.path))
            )

    def __getattr__(self, name):  # tell, flush, fileno, writable, closed: the file's own
        return getattr(self.raw, name)


class _Hashing:
    """What DCP's file systems (its local one, its fsspec one) write, hashed as it goes (`files`)."""

    def __init__(self):
        super().__init__()
        self.files: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def _record(self, name: str, size: int, digest: str) -> None:
        with self._lock:
            self.files[name] = (size, digest)

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _HashingStream(raw, str(path), self._record)
            try:
                yield stream
            finally:
                stream.close()


class _HashingFileSystem(_Hashing, FileSystem):
    pass


class _StoreFileSystem(FsspecFileSystem):
    """DCP's fsspec file system, on the filesystem `fs.filesystem` makes (no listing cache, bounded retries), also
    when DCP sets its path again (`reset`)."""

    def init_path(self, path, **kwargs):
        self.fs = fs.filesystem(str(path))
        return path


class _HashingFsspecFileSystem(_Hashing, _StoreFileSystem):
    pass


class HashingWriter(FileSystemWriter):
    """DCP's file writer that notes the size and hash of each file it writes (`files`), as it writes it."""

    def __init__(self, path: str, threads: int = 1):
        super().__init__(path, thread_count=threads)
        self.fs = _HashingFileSystem()

    @property
    def files(self) -> dict[str, tuple[int, str]]:
        return {name: v for name, v in self.fs.files.items() if not name.endswith(".tmp")}


class HashingFsspecWriter(FsspecWriter):
    """The same for a checkpoint in an object store: DCP's fsspec writer, each object hashed as it is uploaded."""

    def __init__(self, path: str, threads: int = 1):
        # no fsync: an upload is whole; `fs` replaced just below
        super().__init__(path, sync_files=False, thread_count=threads)
        self.fs = _HashingFsspecFileSystem()
        self.path = self.fs.init_path(path)

    files = HashingWriter.files


def writer(path: str, threads: int = 1) -> FileSystemWriter:
    """The writer of checkpoint directory `path` (each rank's part in `threads` files), which records its files for
    the manifest."""
    return HashingFsspecWriter(path, threads) if fs.remote(path) else HashingWriter(path, threads)


def reader(path: str) -> FileSystemReader:
    """DCP's reader of checkpoint `path`, local or in an object store."""
    if fs.remote(path):
        found = FsspecReader(path)  # its filesystem replaced just below
        found.fs = _StoreFileSystem()
        found.path = found.fs.init_path(path)
        return found
    return FileSystemReader(path)


def write_part(directory: str, rank: int, files: dict[str, tuple[int, str]]) -> None:
    """A rank's files are closed: leave their sizes and hashes for rank 0 to gather (`write_manifest`)."""
    with fs.open(os.path.join(directory, _PART.format(rank)), "w") as f:
        json.dump({name: {"size": size, HASH: digest} for name, (size, digest) in files.items()}, f)


def write_manifest(directory: str, last: str = ".metadata") -> None:
    """Every rank has written its files and its part: gather the parts, add `last` (the file that makes it a
    checkpoint, written last), write the manifest."""
    files = {}
    prefix, suffix = _PART.split("{}")
    for name in sorted(n for n in fs.listdir(directory) if n.startswith(prefix) and n.endswith(suffix)):
        part = os.path.join(directory, name)
        with fs.open(part, "r") as f:
            files.update(json.load(f))
        fs.remove(part)
    size, digest = file_hash(os.path.join(directory, last))
    files[last] = {"size": size, HASH: digest}
    with fs.open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"hash": HASH, "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        if not fs.remote(directory):
            os.fsync(f.fileno())


def write_manifest_of_all(directory: str, last: str) -> None:
    """A checkpoint whose writer records nothing (DeepSpeed's): hash every file it holds, then `write_manifest`."""
    files = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            if name != last and not name.startswith(".manifest"):
                files[os.path.relpath(path, directory)] = file_hash(path)
    write_part(directory, 0, files)
    write_manifest(directory, last)


def _file_problem(directory: str, name: str, entry: dict) -> str | None:
    path = os.path.join(directory, name)
    if not fs.isfile(path):
        return f"its file {name} is missing"
    size = fs.getsize(path)
    if size != entry["size"]:
        return f"its file {name} is {size} bytes, {entry['size']} were written"
    if file_hash(path)[1] != entry[HASH]:
        return f"its file {name} does not hold the bytes written ({size} bytes, its {HASH} hash differs)"
    return None


def notice_unverifiable(directory: str) -> None:
    """Once per process: say that checkpoint `directory`, loadable but written before manifests, cannot be
    verified."""
    if directory not in _noticed and not has_manifest(directory):
        _noticed.add(directory)
        log.warning(
            "checkpoint %s has no %s (written before checkpoints recorded their files): it cannot be verified",
            directory,
            MANIFEST,
        )


def problem(directory: str) -> str | None:
    """What is wrong with the files of checkpoint `directory` against its manifest, or None when each is as
    written. None too for a checkpoint without a manifest (written before them): see `notice_unverifiable`."""
    path = os.path.join(directory, MANIFEST)
    if not fs.isfile(path):
        return None
    try:
        with fs.open(path, "r") as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("hash") != HASH or not all(
            isinstance(e, dict) and {"size", HASH} <= e.keys() for e in files.values()
        ):
            raise ValueError(f"not a {HASH} manifest")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its manifest {MANIFEST} cannot be read ({type(e).__name__}: {e})"
    state = _state(directory, files)
    if _verified.get(directory) == state:  # checked whole already by this process, and not changed since
        return None
    for name, entry in files.items():
        found = _file_problem(directory, name, entry)
        if found:
            return found
    _verified[directory] = state
    return None


def _state(directory: str, files) -> tuple:
    """What tells whether a checkpoint's files changed since they were verified: their sizes and mtimes (an
    object's size and ETag)."""
    state = []
    for name in files:
        found = fs.stamp(os.path.join(directory, name))
        if found is None:
            return ()
        state.append((name, *found))
    return tuple(state)


def has_manifest(directory: str) -> bool:
    return fs.isfile(os.path.join(directory, MANIFEST))
