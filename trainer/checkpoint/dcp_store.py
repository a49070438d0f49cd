"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, LR schedule, data position, RNG.

Model and optimizer go through `get_state_dict`/`set_state_dict`, so a checkpoint saved under one strategy and
world size loads under another (DCP reshards; pipeline stages each save their own parameters under the unsplit
model's names). Each save is written whole or not at all (`trainer.checkpoint.writing`). With
`train.checkpoint_async` the write goes on in the background (`AsyncSaver`) and is renamed by the same rule once
the run waits for it. `DCPStore` is the store of every strategy but DeepSpeed (`trainer.checkpoint.store`).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainer.checkpoint import fs, layout, manifest, writing

log = logging.getLogger(__name__)

# The optimizer's state and settings are kept per parameter, under its name ("optim.state.<name>.exp_avg",
# "optim.param_groups.<name>.lr"): under pipeline parallelism each rank holds some parameters, and DCP merges
# these keys into those of the whole model, whatever strategy saved or loads them.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED = StateDictOptions(flatten_optimizer_state_dict=False)


def _options(keys) -> StateDictOptions:
    """How checkpoint keys `keys` hold the optimizer: per parameter (`optim.param_groups.<name>.lr`), or (older
    checkpoints) per param group (`optim.param_groups.<index>.lr`). A name may begin with a digit too (`0.weight` of
    an `nn.Sequential`): an index is the whole of its part."""
    nested = any(k.startswith("optim.param_groups.") and k.count(".") == 3 and k.split(".")[2].isdigit()
                 for k in keys)
    return NESTED if nested else FLAT


def _rng_key() -> str:
    return f"rng.rank{dist.get_rank()}"


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _state(root: str, step: int, model, optimizer, train_state: dict, device: torch.device) -> dict:
    """Every rank: make the checkpoint's temporary directory fresh, and gather what it holds."""
    writing.begin(root, step)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
    return {"model": model_sd, "optim": optim_sd, "train": train_state, _rng_key(): _rng_state(device)}


def _writer(path: str, threads: int) -> dcp.FileSystemWriter:
    """The writer of checkpoint directory `path`, into `threads` files per rank: one that records its files for the
    manifest (always in an object store, where the manifest is what makes it whole)."""
    if manifest.HASH_FILES or fs.remote(path):
        return manifest.writer(path, threads)
    return dcp.FileSystemWriter(path, thread_count=threads)


def _hashing(writer: dcp.FileSystemWriter) -> bool:
    return isinstance(writer, manifest.HashingWriter | manifest.HashingFsspecWriter)


def _written(writer: dcp.FileSystemWriter, root: str, step: int) -> None:
    """This rank's files of checkpoint `step` are closed: leave their sizes and hashes for the manifest."""
    if _hashing(writer):
        manifest.write_part(layout.paths(root, step)[0], dist.get_rank(), writer.files)


def _complete(root: str, step: int, keep_latest_k: int, writer: dcp.FileSystemWriter) -> str:
    """Every rank has written its part of checkpoint `step` (with `writer`): write its manifest, rename it whole,
    keep the newest `keep_latest_k`."""
    return writing.complete(root, step, keep_latest_k,
                            manifest.write_manifest if _hashing(writer) else None)


def save(root: str, step: int, model, optimizer, train_state: dict, keep_latest_k: int,
         device: torch.device, threads: int = 1) -> str:
    """Write checkpoint `step` collectively (every rank calls this, each into `threads` files) and keep the newest
    `keep_latest_k`."""
    state = _state(root, step, model, optimizer, train_state, device)
    tmp = layout.paths(root, step)[0]
    writer = _writer(tmp, threads)
    try:
        dcp.save(state, checkpoint_id=tmp, storage_writer=writer)
        _written(writer, root, step)
    except BaseException as e:  # DCP's CheckpointException (a failed write, on every rank) is a BaseException
        writing.failed(e, root, step)
    return _complete(root, step, keep_latest_k, writer)


class AsyncSaver:
    """`train.checkpoint_async=true`, as TorchTitan saves: `dcp.async_save` copies the state to CPU memory
    (pinned where there is a GPU), which is all a step waits for, and writes it from a background thread. The
    ranks coordinate that write over a gloo group of their own, apart from training's collectives. A save
    first waits for the one in flight; `wait()` (every rank calls it: before the next save, at SIGTERM, at the
    end of the run) completes it by the same rule as a synchronous save: renamed only when whole, a failed
    write raised here and its partial directory removed."""

    def __init__(self, device: torch.device):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))
        self.group = dist.new_group(backend="gloo")  # every rank makes it, in the same order
        self.pending: tuple | None = None  # (future, writer, root, step, keep_latest_k) of the write in flight

    def save(self, root: str, step: int, model, optimizer, train_state: dict, keep_latest_k: int,
             device: torch.device, threads: int = 1) -> str:
        self.wait()
        state = _state(root, step, model, optimizer, train_state, device)
        tmp, final = layout.paths(root, step)
        writer = _writer(tmp, threads)
        try:
            future = dcp.async_save(state, checkpoint_id=tmp, storage_writer=writer, process_group=self.group,
                                    async_stager=self.stager)
        except BaseException as e:
            writing.failed(e, root, step)
        self.pending = (future, writer, root, step, keep_latest_k)
        return final

    def wait(self) -> str | None:
        """Complete the write in flight, if any (every rank calls this); the checkpoint it made."""
        if self.pending is None:
            return None
        future, writer, root, step, keep = self.pending
        self.pending = None
        try:
            future.result()
            _written(writer, root, step)
        except BaseException as e:
            log.error("the background write of checkpoint step %d failed: %s", step, e)
            writing.failed(e, root, step)
        return _complete(root, step, keep, writer)

    def close(self) -> None:
        self.stager.close()


def load(path: str, model, optimizer, train_state: dict, device: torch.device) -> dict:
    """Load checkpoint `path` into `model` and `optimizer` in place; return its train state.

    `train_state` gives the keys (and types) to read back. The RNG state is restored only when the
    checkpoint holds one for this rank (it may have been saved with another world size).
    """
    keys = manifest.reader(path).read_metadata().state_dict_metadata
    options = _options(keys)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd, "train": dict(train_state)}
    has_rng = any(k.startswith(_rng_key() + ".") for k in keys)
    if has_rng:
        state[_rng_key()] = _rng_state(device)
    dcp.load(state, storage_reader=manifest.reader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    if has_rng:
        torch.set_rng_state(state[_rng_key()]["cpu"])
        if "cuda" in state[_rng_key()]:
            torch.cuda.set_rng_state(state[_rng_key()]["cuda"], device)
    log.info("resumed from %s (step %s)", path, state["train"]["step"])
    return state["train"]


def load_model(path: str, model: torch.nn.Module) -> list[str]:
    """The model of checkpoint `path` into `model` (on the CPU, in this process alone); the names of the model's
    parameters it lacks: none, as DCP refuses to load without them."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP says it assumes a single process: it is one here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=manifest.reader(path))
    return []


class DCPStore:
    """The checkpoints of a run whose model and optimizer are its own (every strategy but DeepSpeed): saved
    synchronously or, with `asynchronous` (train.checkpoint_async), in the background; each rank's part in `threads`
    files (train.checkpoint_threads)."""

    def __init__(self, model, optimizer, device: torch.device, asynchronous: bool, threads: int = 1):
        self.model, self.optimizer, self.device, self.threads = model, optimizer, device, threads
        self.background = AsyncSaver(device) if asynchronous else None

    def save(self, root: str, step: int, train_state: dict, keep_latest_k: int) -> str:
        """Write checkpoint `step` (every rank calls this); with train.checkpoint_async, in the background: the path
        is where it will be once `finish` (or the next save) has completed it."""
        write = self.background.save if self.background is not None else save
        return write(root, step, self.model, self.optimizer, train_state, keep_latest_k, self.device, self.threads)

    def load(self, path: str, train_state: dict) -> dict:
        return load(path, self.model, self.optimizer, train_state, self.device)

    def finish(self) -> None:
        """The checkpoint in flight, if any, written whole, and the staging memory released (nothing to do when
        saving synchronously)."""
        if self.background is not None:
            try:
                self.background.wait()
            finally:
                self.background.close()
