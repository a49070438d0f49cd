"""How every store writes a checkpoint, collectively: `begin` makes its temporary directory fresh, the ranks write
their parts into it, and `complete` has rank 0 write its manifest, rename it whole and prune the oldest; a write
that failed leaves no partial directory (`failed`), and a full disk says so (`no_space`). A rank killed mid-save
so never leaves a half-written checkpoint where resume would find it."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import NoReturn

import torch.distributed as dist

from trainer.checkpoint import fs, layout, lines, manifest

log = logging.getLogger(__name__)
CONFIG = "config.yaml"  # the run's config, as trainjob.run_files.RunDir names it


def begin(root: str, step: int) -> str:
    """Every rank: make the temporary directory of checkpoint `step` fresh (rank 0), once all have come; it."""
    tmp, _ = layout.paths(root, step)

    def fresh() -> None:
        fs.makedirs(root)
        fs.rmtree(tmp)

    _on_rank_0(fresh, root, step)
    return tmp


def complete(root: str, step: int, keep_latest_k: int, write_manifest=None) -> str:
    """Every rank has written its part of checkpoint `step`: rank 0 writes its manifest
    (`write_manifest(directory)`, where one is kept), renames it whole and keeps the newest `keep_latest_k`."""
    tmp, final = layout.paths(root, step)
    dist.barrier()

    def finish() -> None:
        if write_manifest is not None and (manifest.HASH_FILES or fs.remote(tmp)):
            write_manifest(tmp)  # last, once every rank's files are closed: in an object store, what makes it whole
        if tmp != final:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)

    _on_rank_0(finish, root, step)
    if dist.get_rank() == 0:
        # The checkpoint is whole now: a store that fails the pruning of older ones fails no save (the next
        # save prunes them, or fails itself where the store still does not answer).
        try:
            lines.prune(root, keep_latest_k)
        except Exception as e:
            log.warning("checkpoint step %d is whole; the older ones in %s beyond the newest %d could not be removed "
                        "(%s): the next save tries again", step, root, keep_latest_k, cause(e))
    return final


def _on_rank_0(work, root: str, step: int) -> None:
    """Rank 0 does `work` for checkpoint `step` while the others wait; where it fails, every rank fails that save
    (`failed`), rather than the others waiting on for a rank that has left."""
    error = None
    if dist.get_rank() == 0:
        try:
            work()
        except Exception as e:  # the store's errors are of many kinds: each is this save's failure
            error = e
    said = [None if error is None else cause(error)]
    dist.broadcast_object_list(said, src=0)
    if said[0] is not None:
        failed(error or RankZeroFailed(said[0]), root, step)


class RankZeroFailed(RuntimeError):
    """What rank 0's part of a save failed with, as the other ranks hear it (`cause` says it as rank 0 does)."""


def keep_config(root: str, config: str) -> None:
    """Copy the run's config file `config` to `<root>/config.yaml`, where a `train.checkpoint_dir` of its own keeps
    its checkpoints: what export reads of the run that wrote them (`config_of`)."""
    if os.path.isfile(config):
        fs.makedirs(root)
        with open(config, "rb") as src, fs.open(os.path.join(root, CONFIG), "wb") as dst:
            dst.write(src.read())


def config_of(checkpoint: str) -> str:
    """The config file of the run that wrote `checkpoint`: its checkpoint_dir's own copy (`keep_config`), else its
    run directory's (`<run_dir>/checkpoints/step-<N>`)."""
    beside = os.path.join(os.path.dirname(checkpoint.rstrip("/")), CONFIG)
    if fs.remote(checkpoint) or os.path.isfile(beside):
        return beside
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))), CONFIG)


def failed(error: BaseException, root: str, step: int) -> NoReturn:
    """A write of checkpoint `step` failed on every rank (DCP's CheckpointException reaches them all): remove
    the partial directory, and raise (a full disk as OSError ENOSPC, saying what to do; an object store that failed
    as OSError EREMOTEIO, naming the cause; else `error` itself)."""
    tmp, final = layout.paths(root, step)
    interrupted = isinstance(error, KeyboardInterrupt | SystemExit)
    full = not interrupted and no_space(error, root)
    if dist.get_rank() == 0:
        _remove_partial(tmp)  # a partial checkpoint would keep the disk full
    if full:
        raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {final} (the partial one was "
                      f"removed): free space in {root}, then run again to resume from the last checkpoint") from error
    if fs.remote(root) and not interrupted:
        raise OSError(errno.EREMOTEIO, f"checkpoint step {step} could not be written to {final} ({cause(error)}, "
                      f"after up to {fs.retries()} retries of each request): the checkpoints before it in {root} "
                      "are whole; run again to resume from the newest once the store answers") from error
    raise error


def cause(error: BaseException) -> str:
    """The first failure `error` wraps (DCP's CheckpointException holds each rank's), in one line."""
    for e in _chain(error):
        if isinstance(e, RankZeroFailed):
            return str(e)
        if not _wraps(e):
            text = str(e).strip()
            return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
    return type(error).__name__


def _wraps(error: BaseException) -> bool:
    return bool(getattr(error, "failures", None))


def _chain(error: BaseException):
    """`error` and every exception it wraps or was raised from, outermost first."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> (exception, traceback)
        wrapped = [f[0] if isinstance(f, tuple) else f for f in (failures or {}).values()] \
            if isinstance(failures, dict) else []
        todo += [*[w for w in wrapped if isinstance(w, BaseException)], e.__cause__, e.__context__]


def _remove_partial(tmp: str) -> None:
    """Remove the partial checkpoint `tmp`, if the store still answers (one without its manifest is never taken for
    a checkpoint, and the next save of its step replaces it)."""
    try:
        fs.rmtree(tmp)
    except Exception as e:  # the store that failed the write may fail this too: the failure said is the write's
        log.warning("the partial checkpoint %s was left (%s)", tmp, e)


def no_space(error: BaseException, path: str) -> bool:
    """Whether `error` (or what it wraps) came of a full disk: an ENOSPC in its chain, or less than 1 MiB left
    where `path` is (torch's writer reports a short write as "unexpected pos", without the errno)."""
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _chain(error)):
        return True
    if fs.remote(path):
        return False
    try:
        return shutil.disk_usage(path).free < 2**20
    except OSError:
        return False
