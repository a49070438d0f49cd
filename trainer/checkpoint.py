"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, LR schedule, data position, RNG.

`checkpoints/step-<N>/` is written under a temporary name and renamed once every rank has finished, so a
rank killed mid-save never leaves a half-written checkpoint where resume would find it. Model and
optimizer go through `get_state_dict`/`set_state_dict`, so a checkpoint saved under one strategy and
world size loads under another (DCP reshards; pipeline stages each save their own parameters under the
unsplit model's names). With `train.checkpoint_async` the write goes on in the background (`AsyncSaver`) and
is renamed by the same rule once the run waits for it.

`checkpoints/` holds one line of training: resuming from an earlier checkpoint than the newest starts a
new line, and the later checkpoints of the old one are moved aside into `checkpoints/abandoned-<time>/`
(and logged), where neither `resume=auto` nor pruning looks. So along the directory's `step-<N>`
folders a higher step is always a newer checkpoint, and `keep_latest_k` keeps the newest of this line.

Loading unpickles the checkpoint's metadata: a checkpoint is trusted like code.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainer import checkpoint_files
from trainer.config.train import DEEPSPEED_FILE
from trainer.errors import ConfigError

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step-(\d+)$")



def _steps(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and is_checkpoint(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest(root: str) -> str | None:
    """The newest complete checkpoint under `root` that can be loaded, or None; each newer one that cannot
    (a file that is not as written, a garbage .metadata, a truncated shard) is passed over with a warning that
    says why."""
    for _, path in reversed(_steps(root)):
        problem = damage(path)
        if problem is None:
            return path
        log.warning("checkpoint %s cannot be loaded (%s): resuming from an earlier one", path, problem)
    return None


def set_aside_damaged(root: str) -> None:
    """Move each checkpoint of `root` newer than its newest whole one into `root/damaged-<time>/` (never
    deleted: a user may want to look at it), so that resume and pruning no longer meet it; a warning for each
    says why."""
    aside = None
    for _, path in reversed(_steps(root)):
        problem = damage(path)
        if problem is None:
            return
        aside = aside or tempfile.mkdtemp(prefix=time.strftime("damaged-%Y%m%d-%H%M%S-", time.gmtime()), dir=root)
        os.rename(path, os.path.join(aside, os.path.basename(path)))
        log.warning("checkpoint %s is damaged (%s): moved to %s; resuming from an earlier one", path, problem, aside)


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) or is_deepspeed(path)


def is_deepspeed(path: str) -> bool:
    """Whether checkpoint `path` is DeepSpeed's (strategy=deepspeed)."""
    return os.path.isfile(os.path.join(path, DEEPSPEED_FILE))


def _deepspeed_record(path: str) -> dict:
    with open(os.path.join(path, DEEPSPEED_FILE)) as f:
        return json.load(f)


def damage(path: str) -> str | None:
    """Why checkpoint `path` cannot be loaded, or None: a file is not as its manifest says it was written
    (`checkpoint_files.problem`: missing, another size, other bytes), its .metadata does not unpickle, or a shard
    file is missing or shorter than the metadata says (cut short by a full disk or a copy)."""
    problem = checkpoint_files.problem(path)
    if problem or is_deepspeed(path):  # DeepSpeed's files are known by its manifest alone
        return problem
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # unpickling garbage raises anything: UnpicklingError, EOFError, ValueError, ...
        return f"its .metadata cannot be read: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            return f"its shard {name} is missing"
        if os.path.getsize(shard) < end:
            return f"its shard {name} is truncated ({os.path.getsize(shard)} of {end} bytes)"
    checkpoint_files.notice_unverifiable(path)  # only for one that loads: a damaged one gets its one error line
    return None


def set_aside_later(root: str, start: str) -> None:
    """Resuming from `start` continues the line it is on: move the checkpoints of `root` that are not on
    it (those after `start` when it is in `root`, else all) into `root/abandoned-<time>/`, and say so."""
    start = os.path.realpath(start)
    m = STEP_DIR.match(os.path.basename(start))
    own = m is not None and os.path.dirname(start) == os.path.realpath(root)
    from_step = int(m.group(1)) if own else -1
    later = [path for step, path in _steps(root) if step > from_step]
    if not later:
        return
    # A unique folder: two branches within one second must not collide.
    aside = tempfile.mkdtemp(prefix=time.strftime("abandoned-%Y%m%d-%H%M%S-", time.gmtime()), dir=root)
    for path in later:
        os.rename(path, os.path.join(aside, os.path.basename(path)))
    names = [os.path.basename(p) for p in later]
    log.warning("resuming from %s starts a new line: %s, of the line it leaves, moved to %s "
                "(resume=auto and pruning no longer see them; delete them yourself when not needed)",
                start, ", ".join(names), aside)


BRANCH_FILE = ".branch"


def record_branch(root: str, start: str) -> None:
    """Note in `root` that this run's line starts at checkpoint `start` (an explicit train.resume), so that a
    restart with the same config goes on along the line instead of branching again."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, BRANCH_FILE), "w") as f:
        json.dump({"from": os.path.realpath(start)}, f)


def branched_from(root: str) -> str | None:
    """The checkpoint this run's line started from (see `record_branch`), or None."""
    try:
        with open(os.path.join(root, BRANCH_FILE)) as f:
            return json.load(f)["from"]
    except (OSError, ValueError, KeyError):
        return None


def check_model(path: str, model_cfg, key: str, value) -> None:
    """Raise ConfigError (on `key`=`value`) unless checkpoint `path` holds the model `model_cfg` describes:
    the same tensors with the same full shapes."""
    from trainer import models

    with torch.device("meta"):
        built = models.build(model_cfg)
    if is_deepspeed(path):  # its parameters' shapes, as recorded
        wanted = {name: tuple(p.shape) for name, p in built.named_parameters()}
        saved = {k: tuple(v) for k, v in _deepspeed_record(path)["model"].items() if ".lora_" not in k}
        return _same_tensors(path, saved, wanted, key, value)
    wanted = {name: tuple(t.shape) for name, t in built.state_dict().items()}
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    # LoRA adapters (peft=lora) come on top of the model's own tensors; DCP checks them when loading.
    saved = {k.removeprefix("model."): tuple(m.size) for k, m in metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata) and ".lora_" not in k}
    _same_tensors(path, saved, wanted, key, value)


def _same_tensors(path: str, saved: dict, wanted: dict, key: str, value) -> None:
    for name in sorted(saved.keys() | wanted.keys()):
        if saved.get(name) != wanted.get(name):
            raise ConfigError(key, value, f"the checkpoint {path} holds model tensor {name} of shape "
                              f"{saved.get(name)}, this config's model {wanted.get(name)}: set the model.* "
                              "keys it was saved with")


def data_order(cfg) -> dict:
    """What, besides the global batch, fixes which rows a step trains on: a resumed run must keep them."""
    return {"seed": int(cfg.train.seed), "seq_len": int(cfg.data.seq_len)}


_ORDER_KEYS = {"seed": "train.seed", "seq_len": "data.seq_len"}


def check_data_order(path: str, cfg) -> None:
    """Raise ConfigError unless checkpoint `path` was trained with this config's seed and sequence length
    (going on along a line with another would repeat or skip rows, as another global batch would; a new
    line from an explicit train.resume may choose another order). A checkpoint too old to record them
    passes."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    wanted = data_order(cfg)
    saved = {"train": {"data": {k: -1 for k in wanted}}}
    if is_deepspeed(path):
        saved["train"]["data"].update(_deepspeed_record(path)["data"])
    else:
        with warnings.catch_warnings():  # that it reads in this process alone, which is the intent
            warnings.simplefilter("ignore")
            dcp.load(saved, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    for name, value in saved["train"]["data"].items():
        if value != -1 and value != wanted[name]:
            key = _ORDER_KEYS[name]
            raise ConfigError(key, wanted[name], f"the checkpoint {path} was trained with {key}={value}; going "
                              f"on with another would repeat or skip rows: keep {key}={value}, or branch from it "
                              f"deliberately (train.resume={path})")


# The optimizer's state and settings are kept per parameter, under its name ("optim.state.<name>.exp_avg",
# "optim.param_groups.<name>.lr"): under pipeline parallelism each rank holds some parameters, and DCP merges
# these keys into those of the whole model, whatever strategy saved or loads them.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED = StateDictOptions(flatten_optimizer_state_dict=False)


def _options(keys) -> StateDictOptions:
    """How checkpoint keys `keys` hold the optimizer: per parameter, or (older checkpoints) per param group."""
    nested = any(k.startswith("optim.param_groups.") and k.split(".")[2].isdigit() for k in keys)
    return NESTED if nested else FLAT


def _rng_key() -> str:
    return f"rng.rank{dist.get_rank()}"


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _paths(root: str, step: int) -> tuple[str, str]:
    """Where checkpoint `step` is written (a name resume never picks) and where it is renamed to when whole."""
    return os.path.join(root, f".step-{step}.partial"), os.path.join(root, f"step-{step}")


def _state(root: str, step: int, model, optimizer, train_state: dict, device: torch.device) -> dict:
    """Every rank: make the checkpoint's temporary directory fresh, and gather what it holds."""
    tmp, _ = _paths(root, step)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
    return {"model": model_sd, "optim": optim_sd, "train": train_state, _rng_key(): _rng_state(device)}


# Whether saves write a manifest of their files' sizes and hashes (`trainer.checkpoint_files`); bench/checkpoint.py
# turns it off to measure what hashing adds to a save.
HASH_FILES = True


def _writer(path: str) -> dcp.FileSystemWriter:
    return checkpoint_files.HashingWriter(path) if HASH_FILES else dcp.FileSystemWriter(path)


def _written(writer: dcp.FileSystemWriter, root: str, step: int) -> None:
    """This rank's files of checkpoint `step` are closed: leave their sizes and hashes for the manifest."""
    if isinstance(writer, checkpoint_files.HashingWriter):
        checkpoint_files.write_part(_paths(root, step)[0], dist.get_rank(), writer.files)


def _failed(error: BaseException, root: str, step: int) -> NoReturn:
    """A write of checkpoint `step` failed on every rank (DCP's CheckpointException reaches them all): remove
    the partial directory, and raise (a full disk as OSError ENOSPC, saying what to do; else `error` itself)."""
    tmp, final = _paths(root, step)
    full = not isinstance(error, KeyboardInterrupt | SystemExit) and no_space(error, root)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint would keep the disk full
    if full:
        raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {final} (the partial one was "
                      f"removed): free space in {root}, then run again to resume from the last checkpoint") from error
    raise error


def _complete(root: str, step: int, keep_latest_k: int, writer: dcp.FileSystemWriter) -> str:
    """Every rank has written its part of checkpoint `step` (with `writer`): write its manifest, rename it whole,
    keep the newest `keep_latest_k`."""
    return complete(root, step, keep_latest_k, checkpoint_files.write_manifest
                    if isinstance(writer, checkpoint_files.HashingWriter) else None)


def temporary(root: str, step: int) -> str:
    """Where checkpoint `step` is written before it is whole."""
    return _paths(root, step)[0]


def complete(root: str, step: int, keep_latest_k: int, manifest=None) -> str:
    """Every rank has written its part of checkpoint `step`: rank 0 writes its manifest (`manifest(directory)`,
    where one is kept), renames it whole and keeps the newest `keep_latest_k`."""
    tmp, final = _paths(root, step)
    dist.barrier()
    if dist.get_rank() == 0:
        if manifest is not None and HASH_FILES:
            manifest(tmp)  # last, once every rank's files are closed
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        # One line per directory (set_aside_later), so the lowest steps are the oldest checkpoints.
        for _, old in _steps(root)[:-keep_latest_k]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def save(root: str, step: int, model, optimizer, train_state: dict, keep_latest_k: int,
         device: torch.device) -> str:
    """Write checkpoint `step` collectively (every rank calls this) and keep the newest `keep_latest_k`."""
    state = _state(root, step, model, optimizer, train_state, device)
    writer = _writer(_paths(root, step)[0])
    try:
        dcp.save(state, checkpoint_id=_paths(root, step)[0], storage_writer=writer)
        _written(writer, root, step)
    except BaseException as e:  # DCP's CheckpointException (a failed write, on every rank) is a BaseException
        _failed(e, root, step)
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
             device: torch.device) -> str:
        self.wait()
        state = _state(root, step, model, optimizer, train_state, device)
        writer = _writer(_paths(root, step)[0])
        try:
            future = dcp.async_save(state, checkpoint_id=_paths(root, step)[0], storage_writer=writer,
                                    process_group=self.group, async_stager=self.stager)
        except BaseException as e:
            _failed(e, root, step)
        self.pending = (future, writer, root, step, keep_latest_k)
        return _paths(root, step)[1]

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
            _failed(e, root, step)
        return _complete(root, step, keep, writer)

    def close(self) -> None:
        self.stager.close()


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


class Checkpointer:
    """Decides when this run saves (every `train.checkpoint_every` steps and at the last step) and saves the
    model, the optimizer and the train state `train_state()` gives into `root`."""

    def __init__(self, root: str, train_cfg, model, optimizer, train_state, device: torch.device, writer=None):
        self.root, self.every, self.last, self.keep = root, train_cfg.checkpoint_every, train_cfg.max_steps, \
            train_cfg.keep_latest_k
        self.model, self.optimizer, self.train_state, self.device = model, optimizer, train_state, device
        self.background = AsyncSaver(device) if train_cfg.checkpoint_async else None
        # Another engine's own save (strategy=deepspeed): writer(root, step, train_state, keep_latest_k) -> path.
        self.writer = writer

    def step(self, step: int) -> str | None:
        """Step `step` is done: save it when due (every rank calls this); the checkpoint written, if any."""
        if step % self.every == 0 or step == self.last:
            return self.save(step)
        return None

    def save(self, step: int) -> str:
        """Save step `step` now, due or not (every rank calls this). With train.checkpoint_async, the write goes on
        in the background: the path is where it will be once `wait` has completed it."""
        if self.writer is not None:
            return self.writer(self.root, step, self.train_state(), self.keep)
        writer = self.background.save if self.background is not None else save
        return writer(self.root, step, self.model, self.optimizer, self.train_state(), self.keep, self.device)

    def finish(self) -> None:
        """The checkpoint in flight, if any, written whole, and the staging memory released (every rank calls
        this at the end of the run or at SIGTERM; nothing to do when saving synchronously)."""
        if self.background is not None:
            try:
                self.background.wait()
            finally:
                self.background.close()


def load(path: str, model, optimizer, train_state: dict, device: torch.device) -> dict:
    """Load checkpoint `path` into `model` and `optimizer` in place; return its train state.

    `train_state` gives the keys (and types) to read back. The RNG state is restored only when the
    checkpoint holds one for this rank (it may have been saved with another world size).
    """
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    options = _options(keys)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd, "train": dict(train_state)}
    has_rng = any(k.startswith(_rng_key() + ".") for k in keys)
    if has_rng:
        state[_rng_key()] = _rng_state(device)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    if has_rng:
        torch.set_rng_state(state[_rng_key()]["cpu"])
        if "cuda" in state[_rng_key()]:
            torch.cuda.set_rng_state(state[_rng_key()]["cuda"], device)
    log.info("resumed from %s (step %s)", path, state["train"]["step"])
    return state["train"]


def _checkpoints(target: str) -> list[str]:
    """The checkpoints `verify` looks at: `target` itself, or the `step-<N>` folders of a run directory (or of
    its checkpoints/ folder)."""
    if is_checkpoint(target) or checkpoint_files.has_manifest(target):
        return [target]
    for root in (os.path.join(target, "checkpoints"), target):
        if os.path.isdir(root):
            found = [os.path.join(root, n) for n in os.listdir(root) if STEP_DIR.match(n)]
            if found:
                return sorted(found, key=lambda p: int(STEP_DIR.match(os.path.basename(p)).group(1)))
    return []


def verify(target: str) -> int:
    """`python -m trainer.checkpoint verify TARGET`: one line per checkpoint; 0 when every one is whole."""
    found = _checkpoints(target)
    if not found:
        print(f"error: {target} is neither a checkpoint nor a run directory with checkpoints", file=sys.stderr)
        return 2
    damaged = 0
    for path in found:
        m = STEP_DIR.match(os.path.basename(path))
        name = f"step {m.group(1)}" if m else path
        problem = damage(path) if is_checkpoint(path) else "its .metadata is missing"
        if problem:
            damaged += 1
            print(f"{name}: damaged: {problem} ({path})")
        elif checkpoint_files.has_manifest(path):
            print(f"{name}: whole ({path})")
        else:
            print(f"{name}: whole as far as sizes tell (no manifest: written before checkpoints recorded their "
                  f"files' hashes) ({path})")
    return 1 if damaged else 0


def main(argv: list[str] | None = None) -> int:
    from trainjob.cli import OneLineParser

    parser = OneLineParser(prog="python -m trainer.checkpoint", description="Check checkpoints against their "
                           "manifests.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="say, for each checkpoint, whether its files are as written")
    check.add_argument("target", metavar="RUN_DIR_OR_CHECKPOINT")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the lines printed here say it all
    return verify(args.target)


if __name__ == "__main__":
    sys.exit(main())
