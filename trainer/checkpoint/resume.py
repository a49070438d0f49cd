"""Where a run starts, decided once and carried: `decide` works out the checkpoint from `train.resume` (auto: the
newest whole one in `train.checkpoint_dir`; never: none; a path: that one, or, on a restart of the line that began
there, the line's newest; `decide_at_launch`, the driver's, also refuses a fresh run over a URL's checkpoints);
`agreed` has rank 0 decide and hands its decision to every rank; `reach`, before either, asks a URL's store. `check`
refuses a start the run cannot load (one ConfigError line, before the first step), `settle` has rank 0 set aside
what the start leaves behind before the ranks load it, and `restore` loads it through the run's store."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from trainer.checkpoint import checks, fs, layout, lines
from trainer.config.runtime import config_errors
from trainer.errors import ConfigError
from trainjob.storage import objects


@dataclass(frozen=True)
class Start:
    """The checkpoint a run starts from (`path`); `branches`: it is the explicit train.resume, where a new line
    begins (else the run goes on along its own line)."""

    path: str
    branches: bool


def reach(cfg) -> None:
    """Raise ConfigError unless the run `cfg`'s `train.checkpoint_dir`, where it is an object store's URL, answers,
    takes this process's credentials and holds the bucket. Run where the ranks run (the driver, where they run on
    this machine; each rank): a cluster's ranks take a Secret's credentials, which the driver does not have.
    Writes nothing."""
    url = cfg.train.checkpoint_dir
    if not fs.remote(url):
        return
    fs.configure(cfg.train.checkpoint_retries)
    with config_errors():  # the store's refusal, a config error like any other
        objects.probe("train.checkpoint_dir", url)


def decide_at_launch(cfg) -> Start | None:
    """`decide`, as the driver asks it before launch, which also refuses a fresh run (`train.resume=never`) over
    the checkpoints a `train.checkpoint_dir` URL already holds (a restart's ranks, `agreed`, go on over their own)."""
    url = cfg.train.checkpoint_dir
    if cfg.train.resume == "never" and fs.remote(url) and fs.listdir(url):
        raise ConfigError("train.resume", "never", f"{url} already holds checkpoints that a fresh run would "
                          "overwrite: use train.resume=auto or another train.checkpoint_dir")
    return decide(cfg)


def _own(cfg) -> str:
    """The run's own checkpoint root (`train.checkpoint_dir`, absent from a config written before the key)."""
    return layout.root(getattr(cfg.train, "checkpoint_dir", ""), cfg.run_dir)


def decide(cfg) -> Start | None:
    """The checkpoint the run `cfg` starts from now, or None (a fresh start); reads, moves nothing."""
    own = _own(cfg)
    if cfg.train.resume == "never":
        return None
    if cfg.train.resume == "auto":  # its checkpoint_dir: another run directory with the same one goes on from it
        path = lines.latest(own)
    elif lines.branched_from(own) == fs.real(cfg.train.resume):
        # A restart of a line that began at this explicit checkpoint (torchrun's restart, a pod's, the same
        # config run again) goes on from the line's newest checkpoint rather than branching again.
        path = lines.latest(own) or cfg.train.resume
    else:
        path = cfg.train.resume
    return None if path is None else Start(path, branches=path == cfg.train.resume)


def agreed(cfg) -> Start | None:
    """Every rank: the start rank 0 decides (`decide`), broadcast; the ranks never decide one each."""
    choice = [decide(cfg) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def check(start: Start | None, cfg) -> None:
    """Raise ConfigError (on train.resume) unless the run `cfg` can load `start`: still a checkpoint, whole,
    written by its strategy's store, of its model and, going on along its line, of its data order."""
    if start is None:
        return
    path, key, value = start.path, "train.resume", cfg.train.resume
    if not layout.is_checkpoint(path):
        raise ConfigError(key, value, f"{path} is no longer a checkpoint (pruned or moved?): give another, or "
                          "train.resume=auto")
    problem = checks.damage(path)
    if problem:
        raise ConfigError(key, value, f"the checkpoint {path} cannot be loaded: {problem}; give another")
    deepspeed = cfg.strategy.data_parallel == "deepspeed"
    if layout.is_deepspeed(path) != deepspeed:
        raise ConfigError(key, value, f"the checkpoint {path} was written by {'DCP' if deepspeed else 'DeepSpeed'}, "
                          f"which strategy={cfg.strategy.name} does not load: resume it with "
                          f"{'another strategy' if deepspeed else 'strategy=deepspeed'}")
    checks.check_model(path, cfg.model, key, value)
    if not start.branches:  # going on along this run's line; an explicit train.resume branches anew
        checks.check_data_order(path, cfg)


def settle(start: Start | None, cfg) -> None:
    """Every rank, before loading `start`: rank 0 sets aside the damaged checkpoints newer than the newest whole
    one and those of the line `start` leaves (`lines.set_aside_damaged`, `lines.set_aside_later`), and notes an
    explicit start, so that later restarts go on along its line; the others wait for it."""
    if dist.get_rank() == 0:
        own = _own(cfg)
        if cfg.train.resume != "never":
            lines.set_aside_damaged(own)
        if start is not None:
            lines.set_aside_later(own, start.path)
            if start.branches:
                lines.record_branch(own, start.path)
    dist.barrier()


def restore(store, path: str, train_state: dict, cfg) -> dict:
    """Load checkpoint `path` through the run's `store` (every rank); its train state, read as `train_state` (the
    run's own, fresh) holds it. Raises ConfigError where the checkpoint was trained with another global batch."""
    order = checks.data_order(cfg)  # checked before (`check`): a checkpoint may predate it
    template = {**train_state, "data": {k: v for k, v in train_state["data"].items() if k not in order}}
    state = store.load(path, template)
    step, seen, batch = int(state["step"]), int(state["data"]["samples_seen"]), cfg.train.global_batch_size
    if step and seen != step * batch:  # the data position is step x batch: it would move
        raise ConfigError("train.global_batch_size", batch,
                          f"the checkpoint {path} was trained with a global batch of {seen // step}; resuming "
                          f"with another would repeat or skip rows: keep train.global_batch_size={seen // step}")
    return state
