"""`strategy=deepspeed`: the DeepSpeed engine (ZeRO stage `strategy.zero_stage`, the optimizer's state offloaded
to the CPU with `strategy.offload_optimizer=cpu`) trains the model in place of the loop's own data parallelism,
under `runtime=deepspeed-distributed`. Its config (`ds_config`) is built from the run's (the batch, the
micro-batches, clipping, precision); the optimizer is the run's own (`trainer.training.optimizer`: torch's, so that no
DeepSpeed op is compiled) and its LR schedule the run's, stepped by the loop. Checkpoints are the engine's own
save and load, reached through the run's checkpoint store (`trainer.checkpoint.deepspeed_store`).

DeepSpeed is imported only here, on the ranks that train with it, and by `trainer.checkpoint.deepspeed_store` to
gather a checkpoint's whole model for export."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.config import torch_dtype


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
