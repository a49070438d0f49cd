"""The `train` section: steps, batch, evals, checkpoints, resuming, preemption and quantization-aware training
(the experiment trackers are the `tracker` section's)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from trainer.config.checks import one_of, require
from trainer.config.precision import AUTO, DTYPES
from trainjob.allocator import POLICIES
from trainjob.storage.urls import is_url, scheme_of

# train.qat: quantization-aware training with torchao (int8 activations quantised per token at run time, int4
# weights in groups of train.qat_group_size along each row).
QAT_SCHEMES = ("none", "int8_dynamic_act_int4_weight")


# What marks a checkpoint that DeepSpeed wrote (strategy=deepspeed: `trainer.checkpoint.deepspeed_store`): its model's
# parameter shapes and data order, written last; DCP's is its .metadata.
DEEPSPEED_FILE = "deepspeed.json"


@dataclass
class TrainConfig:
    # Each must be > 0 (`trainer.config.validate` checks it before `check()`).
    POSITIVE: ClassVar[tuple[str, ...]] = (
        "max_steps", "global_batch_size", "grad_accum_steps", "log_every", "eval_every", "eval_batches",
        "checkpoint_every", "keep_latest_k", "preemption_grace_s"
    )
    seed: int = 0  # seeds the weights' initialisation, the data order and sampling
    max_steps: int = 200  # optimizer steps of the run
    global_batch_size: int = 16  # rows per optimizer step, over all ranks and micro-batches
    grad_accum_steps: int = 1  # micro-batches per optimizer step on each rank
    # auto: bf16 autocast on CUDA, fp32 on CPU.
    mixed_precision: str = AUTO
    # Steps between metrics lines (TorchTitan's default); only a line waits for the device.
    log_every: int = 10
    eval_every: int = 50  # steps between evals (and the last step)
    eval_batches: int = 4  # global batches of the eval split per eval
    checkpoint_every: int = 100  # steps between checkpoints (and the last step)
    keep_latest_k: int = 2  # checkpoints kept, the newest (older ones pruned)
    # Save checkpoints in the background (dcp.async_save): a step waits only for the copy of the state to CPU
    # memory; the next save, SIGTERM and the end of the run wait for the write in flight.
    checkpoint_async: bool = False
    # Files each rank writes a checkpoint into, from as many threads (DCP's thread_count): above 1, an object store
    # receives that many uploads at once and no object is the rank's whole state.
    checkpoint_threads: int = 1
    # Where checkpoints go: a local directory or an object store's URL (s3://bucket/prefix, gs://...), written by
    # every rank directly; empty: <run_dir>/checkpoints. Another run directory with the same one resumes from it.
    checkpoint_dir: str = ""
    # Attempts beyond the first of each request to checkpoint_dir's object store on a transient error (a refused or
    # reset connection, a timeout, a throttled or failed request), with backoff; then the save fails.
    checkpoint_retries: int = 3
    # auto: resume from the latest checkpoint in checkpoint_dir; never: start fresh; or a checkpoint path or URL.
    resume: str = "auto"
    progress: bool = True  # the progress line on a terminal (rank 0)
    # Seconds between SIGTERM (preemption, docker stop) and SIGKILL, for the step in flight and a checkpoint:
    # the pods' terminationGracePeriodSeconds on Kubernetes, docker stop's timeout on Docker.
    preemption_grace_s: int = 30
    # Quantization-aware training (trainer.config.qat): none, or int8_dynamic_act_int4_weight (torchao), whose
    # int4 weights are quantised in groups of qat_group_size along each row.
    qat: str = "none"
    qat_group_size: int = 32  # int4 weights' group size along each row
    # glibc's malloc in each rank (the CPU's memory: activations on the CPU, host buffers on a GPU): release maps
    # every block of 1 MiB or more on its own, so that a freed activation goes back to the kernel at once and the
    # peak resident memory is what the step holds (each new block faults its pages in); adaptive leaves glibc's own
    # thresholds, which keep freed blocks for reuse; auto: release on the CPU where rows hold 8192 tokens or more
    # (data.seq_len; trainjob.allocator.policy_for), adaptive otherwise. A user's MALLOC_* or GLIBC_TUNABLES
    # settings decide over it; a process keeps the first policy set (a multirun in one process: the first job's
    # release stays, and its log says so).
    allocator: str = AUTO

    def check(self) -> None:
        one_of("train.allocator", self.allocator, POLICIES)
        one_of("train.mixed_precision", self.mixed_precision, (AUTO, *DTYPES))
        require(0 <= self.seed < 2**32, "train.seed", self.seed, "must be in [0, 2**32)")
        require(self.checkpoint_threads >= 1, "train.checkpoint_threads", self.checkpoint_threads, "must be >= 1")
        require(self.checkpoint_retries >= 0, "train.checkpoint_retries", self.checkpoint_retries, "must be >= 0")
        require(scheme_of(self.checkpoint_dir) in (None, "s3", "gs"), "train.checkpoint_dir", self.checkpoint_dir,
                "must be a local directory or an s3:// or gs:// URL")
        if self.resume not in ("auto", "never") and not is_url(self.resume):  # a URL: checked where it is read
            require(any(os.path.isfile(os.path.join(self.resume, f)) for f in (".metadata", DEEPSPEED_FILE)),
                    "train.resume", self.resume, "must be auto, never, or a checkpoint directory (such as "
                    f"<run_dir>/checkpoints/step-100, which holds a .metadata file, or DeepSpeed's {DEEPSPEED_FILE})")
        one_of("train.qat", self.qat, QAT_SCHEMES)
        if self.qat != "none":
            require(self.qat_group_size > 0, "train.qat_group_size", self.qat_group_size, "must be > 0")
