"""A run's checkpoint store, chosen once from its strategy (`of_run`): DCP's (`dcp_store.DCPStore`) or, under
strategy=deepspeed, the engine's own (`deepspeed_store.DeepSpeedStore`). Both write `checkpoints/step-<N>/`
whole or not at all, with a manifest, and read back the train state; the loop asks `Checkpointer` to save and
the resume (`trainer.checkpoint.resume.restore`) to load, and never asks which store it has."""

from __future__ import annotations

from typing import Protocol

import torch

from trainer.checkpoint import checks, dcp_store, deepspeed_store, layout


class Store(Protocol):
    def save(self, root: str, step: int, train_state: dict, keep_latest_k: int) -> str:
        """Write checkpoint `step` into `root` (every rank calls this) and keep the newest `keep_latest_k`; the
        path it is (or, written in the background, will be) at."""

    def load(self, path: str, train_state: dict) -> dict:
        """Load checkpoint `path` into the model and optimizer in place (every rank); its train state, read as
        `train_state` holds it."""

    def finish(self) -> None:
        """Every rank, at the end of the run or at SIGTERM: a write in flight completed whole."""


def of_run(cfg, model, optimizer, device: torch.device, engine=None) -> Store:
    """The store of the run `cfg`: the DeepSpeed `engine`'s where there is one, else DCP's over `model` and
    `optimizer`."""
    if engine is not None:
        return deepspeed_store.DeepSpeedStore(engine, checks.data_order(cfg))
    return dcp_store.DCPStore(model, optimizer, device, cfg.train.checkpoint_async, cfg.train.checkpoint_threads)


def load_model(path: str, model: torch.nn.Module) -> list[str]:
    """The whole model of checkpoint `path`, whichever store wrote it, into `model` (fp32, on the CPU, in this
    process alone); the names of the model's parameters it lacks."""
    load = deepspeed_store.load_model if layout.is_deepspeed(path) else dcp_store.load_model
    return load(path, model)


class Checkpointer:
    """Decides when this run saves (every `train.checkpoint_every` steps and at the last step) and saves the
    train state `train_state()` gives into `root` through `store`."""

    def __init__(self, root: str, train_cfg, store: Store, train_state):
        self.root, self.every, self.last, self.keep = root, train_cfg.checkpoint_every, train_cfg.max_steps, \
            train_cfg.keep_latest_k
        self.store, self.train_state = store, train_state

    def step(self, step: int) -> str | None:
        """Step `step` is done: save it when due (every rank calls this); the checkpoint written, if any."""
        if step % self.every == 0 or step == self.last:
            return self.save(step)
        return None

    def save(self, step: int) -> str:
        """Save step `step` now, due or not (every rank calls this). With train.checkpoint_async, the write goes on
        in the background: the path is where it will be once `finish` has completed it."""
        return self.store.save(self.root, step, self.train_state(), self.keep)

    def finish(self) -> None:
        """The checkpoint in flight, if any, written whole (every rank calls this at the end of the run or at
        SIGTERM)."""
        self.store.finish()
