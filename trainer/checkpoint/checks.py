"""What a checkpoint must be before it loads: whole (`damage`: its files as its manifest says they were written, its
DCP metadata readable, no shard cut short), of this config's model (`check_model`) and of its data order
(`check_data_order`, `data_order`).

Reading DCP's metadata unpickles it: a checkpoint is trusted like code."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.checkpoint import fs, layout, manifest
from trainer.errors import ConfigError


def damage(path: str) -> str | None:
    """Why checkpoint `path` cannot be loaded, or None: a file is not as its manifest says it was written
    (`manifest.problem`: missing, another size, other bytes), its .metadata does not unpickle, or a shard
    file is missing or shorter than the metadata says (cut short by a full disk or a copy)."""
    problem = manifest.problem(path)
    if problem or layout.is_deepspeed(path):  # DeepSpeed's files are known by its manifest alone
        return problem
    try:
        metadata = manifest.reader(path).read_metadata()
    except Exception as e:  # unpickling garbage raises anything: UnpicklingError, EOFError, ValueError, ...
        return f"its .metadata cannot be read: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = os.path.join(path, name)
        if not fs.isfile(shard):
            return f"its shard {name} is missing"
        size = fs.getsize(shard)
        if size < end:
            return f"its shard {name} is truncated ({size} of {end} bytes)"
    manifest.notice_unverifiable(path)  # only for one that loads: a damaged one gets its one error line
    return None


VALUE_TENSORS = ("model.value_model.", "model.value_head.")  # recipe=ppo's, kept in the policy's checkpoint


def check_model(path: str, model_cfg, key: str, value) -> None:
    """Raise ConfigError (on `key`=`value`) unless checkpoint `path` holds the model `model_cfg` describes:
    the same tensors with the same full shapes."""
    from trainer import models

    with torch.device("meta"):
        built = models.build(model_cfg)
    if layout.is_deepspeed(path):  # its parameters' shapes, as recorded
        wanted = {name: tuple(p.shape) for name, p in built.named_parameters()}
        saved = {k: tuple(v) for k, v in layout.deepspeed_record(path)["model"].items() if ".lora_" not in k}
        return _same_tensors(path, saved, wanted, key, value)
    wanted = {name: tuple(t.shape) for name, t in built.state_dict().items()}
    metadata = manifest.reader(path).read_metadata().state_dict_metadata
    # LoRA adapters (peft=lora) and recipe=ppo's value model or head come on top of the model's own tensors; DCP
    # checks them when loading.
    saved = {k.removeprefix("model."): tuple(m.size) for k, m in metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata) and ".lora_" not in k
             and not k.startswith(VALUE_TENSORS)}
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
    if layout.is_deepspeed(path):
        saved["train"]["data"].update(layout.deepspeed_record(path)["data"])
    else:
        with warnings.catch_warnings():  # that it reads in this process alone, which is the intent
            warnings.simplefilter("ignore")
            dcp.load(saved, storage_reader=manifest.reader(path), planner=DefaultLoadPlanner(allow_partial_load=True),
                     no_dist=True)
    for name, value in saved["train"]["data"].items():
        if value != -1 and value != wanted[name]:
            key = _ORDER_KEYS[name]
            raise ConfigError(key, wanted[name], f"the checkpoint {path} was trained with {key}={value}; going "
                              f"on with another would repeat or skip rows: keep {key}={value}, or branch from it "
                              f"deliberately (train.resume={path})")
