"""The training loop: micro-batches with gradient accumulation, clipping, optimizer and LR schedule,
periodic eval, metrics, checkpoints, and the run's summary.

The data position is a count of global batches, so a resumed run (with any world size, as long as the
global batch is the same) continues with exactly the rows that were not yet trained on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time

import pyarrow as pa
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader
from tqdm import tqdm

from datacache import DataCacheError, LocalDataset, StreamingDataset
from datacache.planned import PlannedDataset
from trainer import checkpoint, metrics, models, parallel, plots, progress, tracking
from trainer.config import CACHE_KEYS, ConfigError
from trainer.parallel.tp import uses_loss_parallel

log = logging.getLogger(__name__)
# What rank 0 reports to a TrainJob's status.trainerStatus (trainer/progress.py), from its metrics lines.
PROGRESS_METRICS = ("loss", "eval_loss", "tokens_per_s", "mfu", "lr", "grad_norm")


def build_optimizer(cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    # No weight decay on norms' gains (1-D parameters), as usual for transformers.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a replicated DTensor (the loss under loss parallelism) gives its local copy."""
    return t.to_local() if hasattr(t, "to_local") else t


def _mean_across_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _keep_metrics_until(path: str, step: int) -> None:
    """Drop the records after `step`, where this run goes on from: what followed was never kept (a
    failed attempt, or a line abandoned by resuming from an earlier checkpoint). A line cut short (a
    kill, a full disk) is dropped too, and said so."""
    if not os.path.exists(path):
        return
    kept, after, broken = [], 0, 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                broken += 1
                continue
            if record["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                after += 1
    if broken:
        log.warning("%s: dropped %d unreadable line(s) (cut short by a kill or a full disk?)", path, broken)
    if after:
        log.info("%s: dropped %d record(s) after step %d, where this run goes on from", path, after, step)
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def needs_corpus(data_cfg) -> bool:
    """Whether some split is read from the local corpus (not every split comes from cache nodes)."""
    return not all(data_cfg.cache[key] for key in CACHE_KEYS.values())


def split_dataset(data_cfg, split: str, corpus: str | None, **kw) -> PlannedDataset:
    """A split's batches: streamed from the cache nodes named for it, else read from the local corpus."""
    key = CACHE_KEYS[split]
    endpoints = list(data_cfg.cache[key])
    if not endpoints:
        return LocalDataset(os.path.join(corpus, split), **kw)
    try:
        data = StreamingDataset(endpoints, token=data_cfg.cache.token, prefetch=data_cfg.cache.prefetch,
                                tls_root_cert=data_cfg.cache.tls_root_cert, **kw)
        rows, _ = data.schema.field("tokens").type, data.plan  # the nodes are asked what they hold
    except (DataCacheError, ValueError) as e:  # unreachable nodes; fewer rows than one global batch
        raise ConfigError(f"data.cache.{key}", endpoints, str(e)) from None
    if not (pa.types.is_fixed_size_list(rows) and rows.list_size == data_cfg.seq_len + 1):
        raise ConfigError(f"data.cache.{key}", endpoints, f"the nodes hold {split} rows of type {rows}; "
                          f"data.seq_len={data_cfg.seq_len} needs rows of {data_cfg.seq_len + 1} token ids")
    return data


class Trainer:
    def __init__(self, cfg, model: torch.nn.Module, mesh, device: torch.device, corpus: str | None):
        self.cfg, self.model, self.device = cfg, model, device
        t = cfg.train
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        dp_rank, dp_size = parallel.data_parallel_rank(mesh)
        self.optimizer = build_optimizer(cfg.optim, model)
        o = cfg.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, o.warmup_steps, t.max_steps, o.min_lr_ratio))
        shard = {"global_batch_size": t.global_batch_size, "seed": t.seed, "rank": dp_rank, "world_size": dp_size}
        self.train_data = split_dataset(cfg.data, "train", corpus, shuffle=cfg.data.shuffle, **shard)
        self.eval_data = split_dataset(cfg.data, "eval", corpus, shuffle=False, loop=False, **shard)
        self.loss_context = (loss_parallel if uses_loss_parallel(cfg.strategy, cfg.model.vocab_size,
                                                                 mesh["tp"].size())
                             else contextlib.nullcontext)
        self.step = 0
        self.resumed_from: str | None = None
        bf16 = t.mixed_precision == "bf16" or (t.mixed_precision == "auto" and device.type == "cuda")
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16
                         else contextlib.nullcontext())
        inner = parallel.unwrap(model)
        self.flops_per_token = metrics.flops_per_token(
            models.num_params(inner, exclude_embeddings=True), cfg.model.n_layers, cfg.model.n_heads,
            cfg.model.dim // cfg.model.n_heads, cfg.data.seq_len)
        self.peak_flops = metrics.peak_flops(device, bf16)

    def _train_state(self) -> dict:
        epoch, step_in_epoch = self.train_data.plan.position(self.step)
        return {"step": self.step, "scheduler": self.scheduler.state_dict(),
                "data": {"epoch": epoch, "step_in_epoch": step_in_epoch,
                         "samples_seen": self.step * self.cfg.train.global_batch_size}}

    def restore(self, path: str) -> None:
        state = checkpoint.load(path, self.model, self.optimizer, self._train_state(), self.device)
        self.step = int(state["step"])
        seen, batch = int(state["data"]["samples_seen"]), self.cfg.train.global_batch_size
        if self.step and seen != self.step * batch:  # the data position is step x batch: it would move
            raise ConfigError("train.global_batch_size", batch,
                              f"the checkpoint {path} was trained with a global batch of {seen // self.step}; "
                              "resuming with another would repeat or skip rows: keep "
                              f"train.global_batch_size={seen // self.step}")
        self.scheduler.load_state_dict(state["scheduler"])
        self.resumed_from = path

    def _tokens(self, batch: dict) -> torch.Tensor:
        """The batch's token ids on the device, widened there (batches keep their stored type, often int32)."""
        return batch["tokens"].to(self.device, non_blocking=True).long()

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        # Under loss parallelism the logits are vocabulary shards; the caller holds self.loss_context().
        with self.autocast:
            return self.model(tokens[:, :-1], tokens[:, 1:])

    def _train_step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        accum = self.cfg.train.grad_accum_steps
        tokens = self._tokens(batch)
        total = torch.zeros((), device=self.device)
        for i, micro in enumerate(tokens.chunk(accum)):
            sync = contextlib.nullcontext() if i == accum - 1 else parallel.no_grad_sync(self.model)
            with sync, self.loss_context():
                loss = self._loss(micro) / accum
                loss.backward()
            total += _local(loss.detach())
        clip = self.cfg.optim.grad_clip
        grad_norm = parallel.clip_grad_norm_(self.model.parameters(), clip if clip else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        n = 0
        for batch in self.eval_data:
            with self.loss_context():
                total += _local(self._loss(self._tokens(batch)))
            n += 1
            if n == self.cfg.train.eval_batches:
                break
        self.model.train()
        return _mean_across_ranks(total / max(n, 1))

    def _loader(self) -> DataLoader:
        epoch, step_in_epoch = self.train_data.plan.position(self.step)
        self.train_data.set_position(epoch, step_in_epoch)
        workers = self.cfg.data.num_workers
        # Streaming workers start from a fork server: gRPC connections do not survive fork.
        context = "forkserver" if workers and isinstance(self.train_data, StreamingDataset) else None
        return DataLoader(self.train_data, batch_size=None, num_workers=workers,
                          pin_memory=self.device.type == "cuda", persistent_workers=False,
                          prefetch_factor=4 if workers else None, multiprocessing_context=context)

    def _checkpoint(self) -> None:
        checkpoint.save(os.path.join(self.cfg.run_dir, "checkpoints"), self.step, self.model,
                        self.optimizer, self._train_state(), self.cfg.train.keep_latest_k, self.device)

    def _record(self, loss: torch.Tensor, grad_norm: torch.Tensor, steps: int, since: float, started: float) -> dict:
        """The metrics line for this step: where a step waits for the device (and the other ranks). Step time
        and throughput are the means over the `steps` steps since `since`, measured once the device is done."""
        record = {"step": self.step, "loss": _mean_across_ranks(loss), "grad_norm": float(grad_norm)}
        now = time.perf_counter()
        step_time = (now - since) / steps
        tokens_per_s = self.cfg.train.global_batch_size * self.cfg.data.seq_len / step_time
        record.update(lr=self.scheduler.get_last_lr()[0], step_time_s=step_time, tokens_per_s=tokens_per_s,
                      peak_memory_gb=metrics.peak_memory_gb(self.device), elapsed_s=now - started)
        if self.peak_flops:
            record["mfu"] = tokens_per_s / self.world * self.flops_per_token / self.peak_flops
        return record

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        run_dir = cfg.run_dir
        writer = reporter = None
        if self.rank == 0:
            path = os.path.join(run_dir, "metrics.jsonl")
            _keep_metrics_until(path, self.step)
            writer = tracking.open_trackers(cfg, self.step)  # metrics.jsonl and train.trackers
            reporter = progress.ProgressReporter.from_env(t.max_steps, self.step)  # on a TrainJob that asks
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        bar = tqdm(total=t.max_steps, initial=self.step, disable=self.rank != 0 or not t.progress,
                   desc="train", unit="step", dynamic_ncols=True)
        start_step, started = self.step, time.perf_counter()
        logged_step, logged_at = self.step, started
        train_loss = eval_loss = float("nan")
        self.model.train()
        data = iter(self._loader())
        try:
            while self.step < t.max_steps:
                # Loss and norm stay on the device; only a logged line waits for them.
                loss, grad_norm = self._train_step(next(data))
                self.step += 1
                # An eval step is a line too: its eval loss is written, not computed and dropped.
                log_line = (self.step % t.log_every == 0 or self.step % t.eval_every == 0
                            or self.step == t.max_steps)
                if log_line:
                    record = self._record(loss, grad_norm, self.step - logged_step, logged_at, started)
                    train_loss = record["loss"]
                    if self.step % t.eval_every == 0 or self.step == t.max_steps:
                        eval_loss = record["eval_loss"] = self.evaluate()
                    if writer:
                        writer.write(record)
                    if reporter:
                        reporter.update(self.step, {k: record.get(k) for k in PROGRESS_METRICS})
                    bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                    refresh=False)
                elif self.step % t.eval_every == 0:
                    eval_loss = self.evaluate()
                bar.update(1)
                if self.step % t.checkpoint_every == 0 or self.step == t.max_steps:
                    saving = time.perf_counter()
                    self._checkpoint()
                    if not log_line:  # the next line's step time counts training only
                        logged_at += time.perf_counter() - saving
                if log_line:
                    # The next line's step time counts training only, not this line's eval or checkpoint.
                    logged_step, logged_at = self.step, time.perf_counter()
        finally:
            bar.close()
            if writer:
                writer.close(finished=self.step == t.max_steps)
            if reporter:
                reporter.close()
        if math.isnan(eval_loss):
            eval_loss = self.evaluate()
        elapsed = time.perf_counter() - started
        peaks = [None] * self.world
        dist.all_gather_object(peaks, round(metrics.peak_memory_gb(self.device), 4))
        steps_run = self.step - start_step
        summary = {
            "final_eval_loss": eval_loss, "final_train_loss": train_loss, "steps": self.step,
            "steps_this_run": steps_run, "tokens": self.step * tokens_per_step,
            "train_time_s": elapsed,
            "tokens_per_s": steps_run * tokens_per_step / elapsed if steps_run else 0.0,
            "world_size": self.world, "strategy": cfg.strategy.name,
            "params": models.num_params(self.model), "resumed_from": self.resumed_from,
            "peak_memory_gb_per_rank": peaks,
        }
        if self.rank == 0:
            with open(os.path.join(run_dir, "summary.json"), "w") as f:
                # A loss that was never measured (no step run) is null: strict JSON has no NaN.
                json.dump({k: None if isinstance(v, float) and math.isnan(v) else v for k, v in summary.items()},
                          f, indent=2)
            plots.save_loss_png(run_dir)
        log.info("done: step %d, eval loss %.4f, train loss %.4f", self.step, eval_loss, train_loss)
        return summary
