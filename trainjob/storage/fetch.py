"""The one way a URL (`hf://`, `s3://`, `gs://`) becomes local files: `fetch` checks it (the store's refusals as
one-line `StorageError`s, before anything is launched) and copies what it names into a cache keyed by the URL and
the objects' versions (the Hub's commit, the ETags of S3 and GCS), so a second fetch of unchanged objects copies
nothing and a changed object is fetched again. `local` does the same for a value that may be a path.

The cache (`root`): `$TRAINJOB_STORAGE_CACHE`, else `<data cache>/storage` where the data cache is `data.cache_dir`
for a run (so Docker's containers, which mount it, read the same copy) and otherwise its default
(`$TRAINJOB_CACHE`, else `~/.cache/trainjob`). A URL's copies lie in `<root>/<scheme>/<name>-<url hash>/<versions
hash>/`, each with `.fetched.json` (the URL and each object's size and version); `latest` beside them names the
newest, which `HF_HUB_OFFLINE=1` uses (and says so)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass

from trainjob.files import write_whole
from trainjob.storage import hub, objects
from trainjob.storage.errors import StorageError
from trainjob.storage.urls import SCHEMES, is_url, scheme_of

MANIFEST = ".fetched.json"
MODEL_PATTERNS = hub.MODEL_PATTERNS


def root(cache_dir: str | None = None) -> str:
    """The fetch cache: $TRAINJOB_STORAGE_CACHE, else `<cache_dir>/storage` (cache_dir: the run's data.cache_dir;
    None: its default, $TRAINJOB_CACHE else ~/.cache/trainjob)."""
    if os.environ.get("TRAINJOB_STORAGE_CACHE"):
        return os.path.expanduser(os.environ["TRAINJOB_STORAGE_CACHE"])
    base = cache_dir or os.environ.get("TRAINJOB_CACHE") or os.path.join("~", ".cache", "trainjob")
    return os.path.join(os.path.expanduser(base), "storage")


@dataclass(frozen=True)
class Fetched:
    """A URL's local copy: `local`, the path that stands for the URL (the directory, the one file, or the glob
    over the copies); `version`, the hash of the objects' versions; `copied`, whether this fetch copied files."""

    url: str
    local: str
    version: str
    copied: bool


@dataclass(frozen=True)
class _Listing:
    """What a URL names now: each object's path relative to `base` with its size and version, the path under
    the copy that stands for the URL, and how to copy the objects into a directory."""

    objects: dict[str, tuple[int, str]]
    tail: str
    copy: object  # Callable[[str], None]: copy every object into that directory


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _home(cache: str, url: str) -> str:
    """The folder of `url`'s copies."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", url.split("://", 1)[1]).strip("-")[-60:]
    return os.path.join(cache, scheme_of(url), f"{name}-{_hash(url)}")


def _matches(rel: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(os.path.basename(rel), p)
                                   for p in patterns)


def _object_listing(key: str, url: str, patterns: tuple[str, ...] | None) -> _Listing:
    _, path = objects.split(key, url)
    found = objects.listing(key, url)
    glob_at = min((path.find(c) for c in objects.GLOB_CHARS if c in path), default=-1)
    path = path.rstrip("/")
    if glob_at >= 0 or [o.path for o in found] == [path]:  # a glob, or one object: its folder, the rest
        base = path[:glob_at if glob_at >= 0 else len(path)].rsplit("/", 1)[0]
        tail = path[len(base) + 1:]
    else:  # a prefix: everything under it
        base, tail = path, ""
    chosen = {o.path[len(base) + 1:]: o for o in found if _matches(o.path[len(base) + 1:], patterns)}
    if not chosen:
        raise StorageError(key, url, f"holds no file matching {', '.join(patterns or ())}")

    def copy(dest: str) -> None:
        for rel, obj in chosen.items():
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            objects.download(key, url, obj, os.path.join(dest, rel))

    return _Listing({rel: (o.size, o.version) for rel, o in chosen.items()}, tail, copy)


def _hub_listing(key: str, url: str, patterns: tuple[str, ...] | None) -> _Listing:
    repo = hub.parse(key, url)
    sha = hub.commit(key, url, repo)
    wanted = (repo.glob,) if repo.glob else patterns
    return _Listing({"": (0, sha)}, repo.glob or "", lambda dest: hub.download(key, url, repo, sha, wanted, dest))


def _latest(cache: str, url: str) -> str | None:
    """The newest whole copy of `url` in `cache`, or None."""
    try:
        with open(os.path.join(_home(cache, url), "latest")) as f:
            entry = os.path.join(_home(cache, url), f.read().strip())
    except OSError:
        return None
    return entry if os.path.isfile(os.path.join(entry, MANIFEST)) else None


def _offline_copy(key: str, url: str, cache: str) -> Fetched:
    """HF_HUB_OFFLINE=1: the newest copy of `url` fetched before, said so on stderr; none: refused."""
    entry = _latest(cache, url)
    if entry is None:
        raise StorageError(key, url, f"HF_HUB_OFFLINE=1 and no copy of it in {cache}: fetch it once online (or "
                           "unset HF_HUB_OFFLINE)")
    with open(os.path.join(entry, MANIFEST)) as f:
        manifest = json.load(f)
    print(f"{key}={url}: HF_HUB_OFFLINE=1, using the cached copy of commit {manifest['commit']} in {entry}",
          file=sys.stderr)
    return Fetched(url, os.path.join(entry, manifest["tail"]) if manifest["tail"] else entry,
                   os.path.basename(entry), False)


def fetch(key: str, url: str, cache: str | None = None, patterns: tuple[str, ...] | None = None) -> Fetched:
    """Check `url` and copy what it names (the files matching `patterns`; None: all) into the cache `cache`
    (None: `root()`), unless a copy of the same versions is there. Raises StorageError."""
    cache = cache or root()
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        raise StorageError(key, url, f"has a scheme trainjob does not read: give a path, or one of "
                           f"{', '.join(s + '://' for s in SCHEMES)}")
    if scheme == "hf" and hub.parse(key, url) and hub.offline():
        return _offline_copy(key, url, cache)
    try:
        listing = (_hub_listing if scheme == "hf" else _object_listing)(key, url, patterns)
    except StorageError as e:
        if scheme == "hf" and "does not answer" in str(e) and _latest(cache, url):
            raise StorageError(key, url, f"{e.allowed}; HF_HUB_OFFLINE=1 uses the copy fetched before") from None
        raise
    version = _hash({"objects": listing.objects, "patterns": patterns})
    entry = os.path.join(_home(cache, url), version)
    local = os.path.join(entry, listing.tail) if listing.tail else entry
    if os.path.isfile(os.path.join(entry, MANIFEST)):
        return Fetched(url, local, version, False)
    os.makedirs(_home(cache, url), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{version}-", dir=_home(cache, url))
    try:
        listing.copy(tmp)
        commit = listing.objects[""][1] if "" in listing.objects else None
        files = {rel: [size, ver] for rel, (size, ver) in listing.objects.items() if rel} or _files(tmp, commit)
        write_whole(os.path.join(tmp, MANIFEST), json.dumps({"url": url, "tail": listing.tail, "commit": commit,
                                                             "objects": files}, indent=1))
        os.rename(tmp, entry)
    except OSError as e:
        if not os.path.isfile(os.path.join(entry, MANIFEST)):  # another process's rename won: its copy serves
            raise StorageError(key, url, f"cannot be copied into {cache} ({type(e).__name__}: {e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_whole(os.path.join(_home(cache, url), "latest"), version)
    return Fetched(url, local, version, True)


def _files(directory: str, commit: str | None) -> dict[str, list]:
    """Each file under `directory` (a Hub download): its size, and the commit as its version."""
    out = {}
    for top, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(top, name)
            out[os.path.relpath(path, directory)] = [os.path.getsize(path), commit]
    return out


def local(key: str, path: str | None, cache: str | None = None, patterns: tuple[str, ...] | None = None) -> str | None:
    """`path` itself where it is not a URL, else the local path of its fetched copy."""
    return fetch(key, path, cache, patterns).local if path and is_url(path) else path


def origin(file: str) -> tuple[str, int, str] | None:
    """(object URL, size, version) of a file of a fetched copy, None for any other file: what a corpus's
    fingerprint records, so that it names the objects and their versions, wherever the copy lies."""
    directory = os.path.dirname(os.path.abspath(file))
    for _ in range(16):
        manifest = os.path.join(directory, MANIFEST)
        if os.path.isfile(manifest):
            with open(manifest) as f:
                found = json.load(f)
            rel = os.path.relpath(os.path.abspath(file), directory)
            if rel not in found["objects"]:
                return None
            size, version = found["objects"][rel]
            return f"{found['url']}#{rel}", size, version
        if os.path.dirname(directory) == directory:
            return None
        directory = os.path.dirname(directory)
    return None
