"""`strategy=deepspeed`: the DeepSpeed engine (ZeRO stage `strategy.zero_stage`, the optimizer's state offloaded
to the CPU with `strategy.offload_optimizer=cpu`) trains the model in place of the loop's own data parallelism,
under `runtime=deepspeed-distributed`. Its config (`ds_config`) is built from the run's (the batch, the
micro-batches, clipping, precision); the optimizer is the run's own (`trainer.training.optimizer`: torch's, so that no
DeepSpeed op is compiled) and its LR schedule the run's, stepped by the loop. Checkpoints are DeepSpeed's own
save and load (`save`, `load`), in the run's `checkpoints/step-<N>/` with the file that marks them
(`trainer.checkpoint.DEEPSPEED_FILE`).

DeepSpeed is imported only here, on the ranks that train with it."""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch
import torch.distributed as dist

from trainer import checkpoint, checkpoint_files
from trainer.config import torch_dtype

log = logging.getLogger(__name__)


def ds_config(cfg, world: int, device_type: str) -> dict:
    """The DeepSpeed config of the run `cfg` on `world` ranks: every rank holds micro-batches of
    global_batch_size / (world x grad_accum_steps) rows."""
    t, s = cfg.train, cfg.strategy
    zero: dict = {"stage": int(s.zero_stage)}
    if s.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": s.offload_optimizer}
    config = {
        "train_batch_size": t.global_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_micro_batch_size_per_gpu": t.global_batch_size // (world * t.grad_accum_steps),
        "gradient_clipping": cfg.optim.grad_clip or 0.0,
        "zero_optimization": zero,
        # The run's optimizer is torch's (no compiled op): ZeRO partitions it, and offloading keeps it.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if torch_dtype(t.mixed_precision, device_type) == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    return config


def _no_shared_memory_op() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (`deepspeed_shm_comm`) with the C++
    compiler when its communication starts (deepspeed/comm/torch.py `build_shm_op`): minutes on a small machine
    (it looked like a hang: deepspeedai/DeepSpeed#7108 shows the same build), and a failure without g++. Only its
    inference all-reduce uses it; training's collectives are torch.distributed's (gloo), so it is left out."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg, device_type: str):
    """The DeepSpeed engine over `model` and the run's `optimizer`, on the process group this rank joined."""
    import deepspeed

    _no_shared_memory_op()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=ds_config(cfg, dist.get_world_size(), device_type),
                                      dist_init_required=False)
    return engine


def backward(engine):
    """The backward of a micro-batch's loss under the engine: the loss is already the micro-batch's share of the
    step's (`trainer.recipes`), so DeepSpeed does not divide it again."""
    return lambda loss: engine.backward(loss, scale_wrt_gas=False)


def grad_norm(engine) -> torch.Tensor:
    """The gradients' norm before clipping at the engine's last optimizer step."""
    return torch.as_tensor(engine.get_global_grad_norm() or 0.0, dtype=torch.float32)


def _shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """Each parameter's whole shape (ZeRO-3 keeps a shard: its whole shape is `ds_shape`)."""
    return {name: list(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()}


def save(root: str, step: int, engine, train_state: dict, keep_latest_k: int, data_order: dict) -> str:
    """Write checkpoint `step` with DeepSpeed's `save_checkpoint` (every rank calls this): written under a
    temporary name, its manifest and marker file added, renamed whole, the newest `keep_latest_k` kept."""
    tmp = checkpoint.temporary(root, step)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    state = {"train": train_state, "rng": torch.get_rng_state()}
    engine.save_checkpoint(root, tag=os.path.basename(tmp), client_state=state, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, checkpoint.DEEPSPEED_FILE), "w") as f:
            json.dump({"model": _shapes(engine.module), "data": data_order}, f)
    return checkpoint.complete(root, step, keep_latest_k,
                               lambda tmp: checkpoint_files.write_manifest_of_all(tmp, checkpoint.DEEPSPEED_FILE))


def load(path: str, engine) -> dict:
    """Load checkpoint `path` into the engine (model, optimizer partitions); return its train state."""
    _, client = engine.load_checkpoint(os.path.dirname(path), tag=os.path.basename(path),
                                       load_optimizer_states=True, load_lr_scheduler_states=False)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {path}")
    torch.set_rng_state(client["rng"])
    log.info("resumed from %s (step %s)", path, client["train"]["step"])
    return client["train"]


def full_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The whole model of checkpoint `path` in fp32, gathered from its ZeRO partitions (DeepSpeed's
    zero_to_fp32), in one process."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(path), tag=os.path.basename(path))
