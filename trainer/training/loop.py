"""The training loop: micro-batches with gradient accumulation, clipping, the step of the optimizer and its
LR schedule (`trainer.training.optimizer`), periodic eval, metrics, checkpoints, and the run's summary.

The data position is a count of global batches, so a resumed run (with any world size, as long as the
global batch is the same) continues with exactly the rows that were not yet trained on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader

from datacache import StreamingDataset
from trainer import models, parallel, recipes
from trainer.checkpoint import checks, layout, resume, store, writing
from trainer.config import torch_dtype
from trainer.data.splits import split_dataset, trains_without_eval
from trainer.errors import UserCodeError
from trainer.models.kernels import Kernels
from trainer.observability import metrics
from trainer.parallel import ParallelDims, deepspeed
from trainer.recipes.base import Context
from trainer.training import optimizer, preemption
from trainjob.run_files import RunDir, read_summary, write_summary

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg, model: torch.nn.Module, dims: ParallelDims, device: torch.device, corpus: str | None,
                 kernels: Kernels):
        self.cfg, self.model, self.device, self.kernels = cfg, model, device, kernels
        t = cfg.train
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        dp_rank, dp_size = dims.data_parallel_rank()
        self.optimizer = optimizer.build_optimizer(cfg.optim, model, kernels.optimizer)
        self.lr_schedule = optimizer.build_lr_schedule(cfg.lr_schedule, self.optimizer, t.max_steps)
        self.pipeline = getattr(model, "pipeline", None)  # strategy.pp > 1: the schedule over this rank's stages
        self.params = {e: self._num_params(e) for e in (False, True)}  # counted before an engine partitions them
        # strategy=deepspeed: the engine runs the model, the backward and the optimizer's step (ZeRO).
        self.engine = deepspeed.initialize(model, self.optimizer, cfg, device.type) if dims.deepspeed else None
        self.model = model = self.engine or model
        self.loss_context = (loss_parallel if parallel.uses_loss_parallel(cfg.strategy, cfg.model.vocab_size, dims)
                             else contextlib.nullcontext)
        bf16 = torch_dtype(t.mixed_precision, device.type) == torch.bfloat16
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        backward = deepspeed.backward(self.engine) if self.engine else torch.Tensor.backward
        self.recipe = recipes.build(cfg, model, Context(device, dims, autocast, self.loss_context, kernels,
                                                        self.pipeline, backward))
        shard = {"global_batch_size": self.recipe.rows_per_step, "seed": t.seed, "rank": dp_rank,
                 "world_size": dp_size}
        self.train_data = split_dataset(cfg.data, "train", corpus, shuffle=cfg.data.shuffle, loop=True, **shard)
        self.eval_data = (None if trains_without_eval(cfg.data, corpus, self.recipe.rows_per_step) else
                          split_dataset(cfg.data, "eval", corpus, shuffle=False, loop=False, **shard))
        self.step = 0
        self.resumed_from: str | None = None
        self.flops_per_token = metrics.flops_per_token(
            self.params[True], cfg.model.n_layers, cfg.model.n_heads,
            cfg.model.head_dim or cfg.model.dim // cfg.model.n_heads, cfg.data.seq_len)
        self.peak_flops = metrics.peak_flops(device, bf16)
        if self.rank == 0 and t.checkpoint_dir:  # beside its checkpoints, for export to read
            writing.keep_config(t.checkpoint_dir, RunDir.of(cfg.run_dir).config)
        self.checkpointer = store.Checkpointer(layout.root(t.checkpoint_dir, cfg.run_dir), t,
                                               store.of_run(cfg, model, self.optimizer, device, self.engine),
                                               self._train_state)

    def _num_params(self, exclude_embeddings: bool = False) -> int:
        """The whole model's parameter count (under pp, the sum over the pipeline's stages)."""
        count = models.num_params(self.model, exclude_embeddings)
        if self.pipeline is None:
            return count
        return int(self.pipeline.total(torch.tensor(count, dtype=torch.int64, device=self.device)))

    def _train_state(self) -> dict:
        epoch, step_in_epoch = self.train_data.plan.position(self.step)
        return {"step": self.step, "scheduler": self.lr_schedule.state_dict(),
                "data": {"epoch": epoch, "step_in_epoch": step_in_epoch,
                         "samples_seen": self.step * self.cfg.train.global_batch_size,
                         **checks.data_order(self.cfg)}}

    def restore(self, path: str) -> None:
        """Go on from checkpoint `path` (`trainer.checkpoint.resume.restore`), with the optimizer settings this
        config gives."""
        configured = optimizer.settings(self.optimizer)
        state = resume.restore(self.checkpointer.store, path, self._train_state(), self.cfg)
        self.step = int(state["step"])
        self.lr_schedule.load_state_dict(state["scheduler"])
        optimizer.keep_configured(self.optimizer, self.lr_schedule, configured, path)
        self.resumed_from = path

    def _train_step(self, batch: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, clipping, the optimizer and the schedule: under the ATen kernels of kernels=triton
        (on model.impl=transformers the one way our kernels reach its modeling code)."""
        with self.kernels.routing():
            return self._step(batch)

    def _step(self, batch: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        accum = self.cfg.train.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for i, micro in enumerate(self.recipe.micro_batches(batch, accum)):
            last = i == accum - 1 or self.engine is not None  # DeepSpeed knows its accumulation boundary
            sync = contextlib.nullcontext() if last else parallel.no_grad_sync(self.model)
            with sync, self.loss_context():
                total += self.recipe.step(micro)
            if self.engine is not None:  # it counts the micro-batches, and steps (clipping first) after the last
                self.engine.step()
        if self.engine is not None:
            self.lr_schedule.step()
            return total, deepspeed.grad_norm(self.engine)
        clip = self.cfg.optim.grad_clip
        grad_norm = parallel.clip_grad_norm_(self.model.parameters(), clip if clip else math.inf, self.pipeline)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_schedule.step()
        return total, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.eval_data is None:  # no eval split (small data under the default data.eval_percent)
            return float("nan")
        self.model.eval()
        total = torch.zeros((), device=self.device)
        n = 0
        for batch in self.eval_data:
            with self.kernels.routing():
                total += self.recipe.eval_loss(batch)
            n += 1
            if n == self.cfg.train.eval_batches:
                break
        self.model.train()
        return metrics.mean_across_ranks(total / max(n, 1))

    def _loader(self) -> DataLoader:
        epoch, step_in_epoch = self.train_data.plan.position(self.recipe.data_steps(self.step))
        self.train_data.set_position(epoch, step_in_epoch)
        workers = self.cfg.data.num_workers
        # Streaming workers start from a fork server: gRPC connections do not survive fork.
        context = "forkserver" if workers and isinstance(self.train_data, StreamingDataset) else None
        return DataLoader(self.train_data, batch_size=None, num_workers=workers,
                          pin_memory=self.device.type == "cuda", persistent_workers=False,
                          prefetch_factor=4 if workers else None, multiprocessing_context=context)

    def _eval_due(self) -> bool:
        t = self.cfg.train
        return self.eval_data is not None and (self.step % t.eval_every == 0 or self.step == t.max_steps)

    def fit(self) -> dict:
        """Train to `train.max_steps`; each owner decides its own timing: the metrics logger its lines, the
        checkpointer its saves, `_eval_due` the evals."""
        t = self.cfg.train
        done = self._finished_summary()
        if done is not None:
            log.info("the run was already trained to step %d: nothing to do, %s kept", self.step,
                     RunDir.of(self.cfg.run_dir).summary)
            return done
        logger = metrics.MetricsLogger(self.cfg, self.recipe.take_counts, self.device, self.step,
                                       self.flops_per_token, self.peak_flops, extras=self.recipe.record)
        start_step, eval_loss = self.step, float("nan")
        self.model.train()
        data = self.recipe.source = iter(self._loader())
        with preemption.watch() as stop:
            try:
                while self.step < t.max_steps:
                    batch = next(data) if self.recipe.wants_batch(self.step) else None
                    loss, grad_norm = self._train_step(batch)  # on the device: only a metrics line waits
                    self.step += 1
                    evaluated = None
                    if self._eval_due():
                        with logger.paused():
                            evaluated = eval_loss = self.evaluate()
                    logger.log(self.step, loss, grad_norm, self.lr_schedule.get_last_lr()[0], evaluated)
                    with logger.paused():
                        saved = self.checkpointer.step(self.step)
                    if self.step < t.max_steps and stop.requested():
                        with logger.paused():
                            saved = saved or self.checkpointer.save(self.step)
                            self.checkpointer.finish()  # an asynchronous write, whole before the exit
                        logger.preempted(self.step, saved)
                        raise preemption.Preempted(self.step, saved)
                with logger.paused():
                    self.checkpointer.finish()
            except UserCodeError as e:  # during step self.step + 1: its checkpoint is the last one written
                raise e.at_step(self.step + 1) from None
            finally:
                logger.close(finished=self.step == t.max_steps)
        if math.isnan(eval_loss) and self.eval_data is not None:  # no step was run
            eval_loss = self.evaluate()
        return self._summary(start_step, logger, eval_loss)

    def _finished_summary(self) -> dict | None:
        """The summary of a run already trained to its last step (its command run again), read by rank 0 and
        shared: kept as it is rather than rewritten with a run of no steps."""
        found = [None]
        if self.rank == 0 and self.step >= self.cfg.train.max_steps:
            summary = read_summary(self.cfg.run_dir)
            if summary is not None and summary.get("steps") == self.step:
                found[0] = summary
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def _summary(self, start_step: int, logger: metrics.MetricsLogger, eval_loss: float) -> dict:
        """The run's final metrics, the same on every rank; rank 0 writes them to summary.json."""
        elapsed = time.perf_counter() - logger.started
        peaks = [None] * self.world
        dist.all_gather_object(peaks, round(metrics.peak_memory_gb(self.device), 4))
        steps_run, tokens = self.step - start_step, logger.totals["tokens"]
        evaluated = self.eval_data is not None
        summary = {
            "final_eval_loss": eval_loss if evaluated else None,
            "final_train_loss": None if math.isnan(logger.train_loss) else logger.train_loss, "steps": self.step,
            "steps_this_run": steps_run, "tokens": tokens, "trained_tokens": logger.totals["trained_tokens"],
            "train_time_s": elapsed,
            "tokens_per_s": tokens / elapsed if steps_run else 0.0,
            "world_size": self.world, "strategy": self.cfg.strategy.name,
            "params": self.params[False], "resumed_from": self.resumed_from,
            "peak_memory_gb_per_rank": peaks,
        }
        if self.rank == 0:
            write_summary(self.cfg.run_dir, summary)
            from trainer.observability import plots  # matplotlib: at the end, not in each rank's start

            plots.save_loss_png(self.cfg.run_dir)
        if evaluated:
            log.info("done: step %d, eval loss %.4f, train loss %.4f", self.step, eval_loss, logger.train_loss)
        else:
            log.info("done: step %d, train loss %.4f", self.step, logger.train_loss)  # the driver's last line: no eval
        return summary
