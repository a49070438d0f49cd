"""Training metrics: FLOPs per token and MFU (TorchTitan's formula), memory, and `MetricsLogger`, which owns
the metrics lines: when one is written, what it holds, and where it goes (metrics.jsonl and the trackers of
`tracker.report_to`, the TrainJob's progress report, the progress bar)."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from trainer.observability import trackers, trainer_status
from trainjob.run_files import keep_metrics_until, write_event

log = logging.getLogger(__name__)
# What rank 0 reports to a TrainJob's status.trainerStatus (observability/trainer_status.py), from its lines.
PROGRESS_METRICS = ("loss", "eval_loss", "tokens_per_s", "mfu", "lr", "grad_norm")

# Dense peak FLOP/s per device for bf16 (fp32 inputs run on TF32 tensor cores at half of it).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
}


def flops_per_token(num_params_no_embedding: int, n_layers: int, n_heads: int, head_dim: int,
                    seq_len: int) -> float:
    """6·N for the dense layers plus 12·L·H·D·T for attention's score and value products (training)."""
    return 6 * num_params_no_embedding + 12 * n_layers * n_heads * head_dim * seq_len


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value if bf16 else value / 2
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated GPU memory on CUDA, else the process's maximum RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def mean_across_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def note_restart(run_dir: str, step: int, last: dict | None, world: int, runtime) -> None:
    """When this start of the ranks goes on from step `step` of a run that logged before (`last`, its last
    step record), say so in `events.jsonl`: a `reformation` (torchrun re-formed the group: a node was lost
    or joined, or ranks were restarted) or a `resume` (the run started again), with the world size before
    and after, and the step resumed from."""
    if step == 0 or last is None:
        return
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    before = last.get("world_size")
    elastic = runtime is not None and ":" in str(runtime.nnodes)
    kind = "reformation" if restarts or elastic or (before is not None and before != world) else "resume"
    write_event(run_dir, kind, world_size_before=before, world_size_after=world, resumed_from_step=step)
    log.info("%s: world size %s -> %d, going on from step %d", kind, before, world, step)


class MetricsLogger:
    """Writes a metrics line every `log_every` steps, at every eval and at the last step; only a line waits
    for the device (the loss is averaged over the ranks then). Step time and throughput are the means over
    the training steps since the previous line: time spent in `paused()` (eval, checkpoints) is left out.
    A line's `tokens` are the real input tokens of those steps on every data-parallel rank (padding is not
    counted), `trained_tokens` the ones the loss counted (`counts()`, the recipe's); `tokens_per_s` and MFU are
    of real tokens.
    Rank 0 writes `metrics.jsonl` (a resumed run keeps the lines up to where it goes on from) and reports to
    a TrainJob that asks; the progress bar moves every step."""

    def __init__(self, cfg, counts: Callable[[], dict[str, int]], device: torch.device, first_step: int,
                 flops_per_token: float, peak_flops: float | None,
                 extras: Callable[[int], dict[str, float]] | None = None):
        train_cfg = cfg.train
        self.every, self.last, self.counts = train_cfg.log_every, train_cfg.max_steps, counts
        self.totals = {"tokens": 0, "trained_tokens": 0}  # this start's, for the run's summary
        self.device, self.flops_per_token, self.peak_flops = device, flops_per_token, peak_flops
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.trackers = self.reporter = None
        self.samples_per_step = train_cfg.global_batch_size
        if self.rank == 0:
            last = keep_metrics_until(cfg.run_dir, first_step)
            note_restart(cfg.run_dir, first_step, last, self.world, cfg.runtime)
            self.trackers = trackers.open_trackers(cfg, first_step)  # metrics.jsonl and tracker.report_to
            self.reporter = trainer_status.ProgressReporter.from_env(self.last, first_step)  # on a TrainJob that asks
        self.bar = tqdm(total=self.last, initial=first_step, disable=self.rank != 0 or not train_cfg.progress,
                        desc="train", unit="step", dynamic_ncols=True)
        self.started = self._since = time.perf_counter()
        self._since_step, self._paused = first_step, 0.0
        self.train_loss = float("nan")
        self.extras = extras  # a line's recipe-specific numbers, given the steps since the last line
        self.run_dir = cfg.run_dir

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside is not training time."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - begin

    def log(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
            eval_loss: float | None = None) -> None:
        """Step `step` is done with this (on-device) loss and norm; write its line when one is due."""
        if step % self.every == 0 or step == self.last or eval_loss is not None:
            record = {"step": step, "loss": mean_across_ranks(loss), "grad_norm": float(grad_norm), "lr": lr,
                      "world_size": self.world, "samples_seen": step * self.samples_per_step}
            if self.extras:
                record.update(self.extras(step - self._since_step))
            counts = self.counts()  # real input tokens and trained tokens of the steps since the last line
            now = time.perf_counter()  # the device is done: the line waited for it
            trained_s = now - self._since - self._paused
            step_time = trained_s / (step - self._since_step)
            tokens_per_s = counts["tokens"] / trained_s
            record.update(step_time_s=step_time, tokens_per_s=tokens_per_s, **counts,
                          peak_memory_gb=peak_memory_gb(self.device), elapsed_s=now - self.started)
            for key, value in counts.items():
                self.totals[key] += value
            if self.peak_flops:
                record["mfu"] = tokens_per_s / self.world * self.flops_per_token / self.peak_flops
            if eval_loss is not None:
                record["eval_loss"] = eval_loss
            self._write(record)
            self.train_loss = record["loss"]
            self._since, self._since_step, self._paused = now, step, 0.0
        self.bar.update(1)

    def _write(self, record: dict) -> None:
        if self.trackers:
            self.trackers.write(record)
        if self.reporter:
            self.reporter.update(record["step"], {k: record.get(k) for k in PROGRESS_METRICS})
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)

    def preempted(self, step: int, checkpoint: str) -> None:
        """SIGTERM stopped the run after `step`, whose checkpoint is `checkpoint`: an event (rank 0)."""
        if self.rank == 0:
            write_event(self.run_dir, "preemption", at_step=step, world_size=self.world, checkpoint=checkpoint)

    def close(self, finished: bool) -> None:
        """`finished`: every step was trained (else the run failed or was stopped)."""
        self.bar.close()
        if self.trackers:
            self.trackers.close(finished)
        if self.reporter:
            self.reporter.close()
