"""DeepSpeed's checkpoints (strategy=deepspeed): the engine's own `save_checkpoint` and `load_checkpoint`, in the
run's `checkpoints/step-<N>/` like DCP's, written whole or not at all (`trainer.checkpoint.writing`), with a
manifest of every file and the file that marks them (`layout.DEEPSPEED_FILE`: the model's parameter shapes and
the data order, which a resume checks). `DeepSpeedStore` is the store of strategy=deepspeed
(`trainer.checkpoint.store`); `load_model` gathers a checkpoint's whole model for export."""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist

from trainer.checkpoint import layout, manifest, writing

log = logging.getLogger(__name__)


def _shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """Each parameter's whole shape (ZeRO-3 keeps a shard: its whole shape is `ds_shape`)."""
    return {name: list(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()}


class DeepSpeedStore:
    """The checkpoints of a run the DeepSpeed `engine` trains (model, optimizer partitions, RNG, train state);
    `data_order` (`checks.data_order`) is recorded beside the model's shapes."""

    def __init__(self, engine, data_order: dict):
        self.engine, self.data_order = engine, data_order

    def save(self, root: str, step: int, train_state: dict, keep_latest_k: int) -> str:
        """Write checkpoint `step` with DeepSpeed's `save_checkpoint` (every rank calls this): written under a
        temporary name, its manifest and marker file added, renamed whole, the newest `keep_latest_k` kept."""
        tmp = writing.begin(root, step)
        state = {"train": train_state, "rng": torch.get_rng_state()}
        self.engine.save_checkpoint(root, tag=os.path.basename(tmp), client_state=state, save_latest=False)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(tmp, layout.DEEPSPEED_FILE), "w") as f:
                json.dump({"model": _shapes(self.engine.module), "data": self.data_order}, f)
        return writing.complete(root, step, keep_latest_k,
                                lambda tmp: manifest.write_manifest_of_all(tmp, layout.DEEPSPEED_FILE))

    def load(self, path: str, train_state: dict) -> dict:
        """Load checkpoint `path` into the engine (model, optimizer partitions); return its train state (all of it:
        `train_state`'s keys are DCP's to read)."""
        _, client = self.engine.load_checkpoint(os.path.dirname(path), tag=os.path.basename(path),
                                                load_optimizer_states=True, load_lr_scheduler_states=False)
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {path}")
        torch.set_rng_state(client["rng"])
        log.info("resumed from %s (step %s)", path, client["train"]["step"])
        return client["train"]

    def finish(self) -> None:
        """Nothing in flight: DeepSpeed writes within the step."""


def load_model(path: str, model: torch.nn.Module) -> list[str]:
    """The whole model of checkpoint `path` in fp32 into `model`, gathered from its ZeRO partitions (DeepSpeed's
    zero_to_fp32) in this process; the names of the model's parameters it lacks."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    whole = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(path), tag=os.path.basename(path))
    missing = model.load_state_dict(whole, strict=False).missing_keys
    return sorted({name for name, _ in model.named_parameters()} & set(missing))
