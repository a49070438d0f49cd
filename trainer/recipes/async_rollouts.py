"""`recipe.generation.async=true` for recipe=grpo and rloo: the next step's completions are sampled in a background
thread while this step trains, as TRL's async GRPO samples them beside training, with its staleness bound at one
step.

The thread samples from a copy of the policy's weights (`snapshot`, refreshed between steps, when the thread is
idle) and also takes the sampling policy's log-probabilities of its completions, the `old` of the importance ratio,
so the loss corrects for the step of lag. The recipe reads its own prompts from the loop's iterator (one batch
ahead: the batch of step k+1 is read at step k): at a run's first step (or a resumed run's) the batch is sampled
then, waited for; from then on each step takes the batch sampled during the step before, and starts the next one.
What overlaps: the next batch's sampling and old log-probabilities with this step's scoring, reference
log-probabilities, forward, backward and optimizer step. The data position stays a count of trained batches, so a
resumed run samples again the batch that was in flight. Each metrics line holds sample/staleness_mean (the
optimizer steps between the weights that sampled the batch and the ones it trains: 1, 0 at a first step),
perf/generate_s (the thread's sampling) and perf/rollout_wait_s (how long the step waited for it)."""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from trainer.models import unwrap


class AsyncRollouts:
    def __init__(self, recipe):
        self.recipe = recipe
        self.live = unwrap(recipe.model)
        self.snapshot = copy.deepcopy(self.live).requires_grad_(False).eval()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        self.pending: Future | None = None
        self.updates = 0  # optimizer steps taken since this process started

    @torch.no_grad()
    def _refresh(self) -> None:
        for mine, theirs in zip(self.snapshot.parameters(), self.live.parameters(), strict=True):
            mine.copy_(theirs)

    def _start(self, accum: int) -> Future:
        batch = next(self.recipe.source)
        return self.pool.submit(self._sample, batch, accum, self.updates)

    @torch.no_grad()
    def _sample(self, batch: dict, accum: int, version: int) -> tuple:
        r = self.recipe
        start = time.perf_counter()
        autocast = copy.copy(r.ctx.autocast)  # its own: a context manager keeps state while entered
        prompts, rows = r._prompts(batch)
        completions = r._sample(prompts, r.generator, model=self.snapshot, autocast=autocast)
        micros, _, _ = r.micro_rows([p for p in prompts for _ in range(r.G)], completions, accum)
        old = r._logps(self.snapshot, micros, autocast)
        if r.ctx.device.type == "cuda":
            torch.cuda.synchronize(r.ctx.device)
        return prompts, rows, completions, old, version, time.perf_counter() - start

    def take(self, accum: int, times: dict) -> tuple:
        """(prompts' tokens, rows, completions, old log-probabilities by micro-batch) for this step; starts the
        next step's sampling. `times` gets the seconds of sampling and of waiting for it, and the lag."""
        if self.pending is None:
            self._refresh()
            self.pending = self._start(accum)
        start = time.perf_counter()
        prompts, rows, completions, old, version, took = self.pending.result()
        times["perf/rollout_wait_s"] = time.perf_counter() - start
        times["perf/generate_s"] = took
        times["sample/staleness_mean"] = float(self.updates - version)
        self._refresh()  # the weights this step starts from; the thread is idle
        self.pending = self._start(accum)
        self.updates += 1
        return prompts, rows, completions, old
