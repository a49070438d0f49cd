"""How every store writes a checkpoint, collectively: `begin` makes its temporary directory fresh, the ranks write
their parts into it, and `complete` has rank 0 write its manifest, rename it whole and prune the oldest; a write
that failed leaves no partial directory (`failed`), and a full disk says so (`no_space`). A rank killed mid-save
so never leaves a half-written checkpoint where resume would find it."""

from __future__ import annotations

import errno
import os
import shutil
from typing import NoReturn

import torch.distributed as dist

from trainer.checkpoint import layout, lines, manifest


def begin(root: str, step: int) -> str:
    """Every rank: make the temporary directory of checkpoint `step` fresh (rank 0), once all have come; it."""
    tmp, _ = layout.paths(root, step)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return tmp


def complete(root: str, step: int, keep_latest_k: int, write_manifest=None) -> str:
    """Every rank has written its part of checkpoint `step`: rank 0 writes its manifest
    (`write_manifest(directory)`, where one is kept), renames it whole and keeps the newest `keep_latest_k`."""
    tmp, final = layout.paths(root, step)
    dist.barrier()
    if dist.get_rank() == 0:
        if write_manifest is not None and manifest.HASH_FILES:
            write_manifest(tmp)  # last, once every rank's files are closed
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        lines.prune(root, keep_latest_k)
    dist.barrier()
    return final


def failed(error: BaseException, root: str, step: int) -> NoReturn:
    """A write of checkpoint `step` failed on every rank (DCP's CheckpointException reaches them all): remove
    the partial directory, and raise (a full disk as OSError ENOSPC, saying what to do; else `error` itself)."""
    tmp, final = layout.paths(root, step)
    full = not isinstance(error, KeyboardInterrupt | SystemExit) and no_space(error, root)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint would keep the disk full
    if full:
        raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {final} (the partial one was "
                      f"removed): free space in {root}, then run again to resume from the last checkpoint") from error
    raise error


def no_space(error: BaseException, path: str) -> bool:
    """Whether `error` (or what it wraps) came of a full disk: an ENOSPC in its chain, or less than 1 MiB left
    where `path` is (torch's writer reports a short write as "unexpected pos", without the errno)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> (exception, traceback)
        wrapped = [f[0] if isinstance(f, tuple) else f for f in (failures or {}).values()] \
            if isinstance(failures, dict) else []
        todo += [e.__cause__, e.__context__, *[w for w in wrapped if isinstance(w, BaseException)]]
    try:
        return shutil.disk_usage(path).free < 2**20
    except OSError:
        return False
