"""SIGTERM as a preemption notice: what Kubernetes sends a preempted, evicted or drained pod, `docker stop` a
container and torchrun's agent its ranks when it is itself told to stop. The ranks finish the step in
flight, write a checkpoint (with `train.checkpoint_async`, waiting for the write in flight to be whole) and
leave with exit code 143 (128 + SIGTERM), within `train.preemption_grace_s`; relaunching the run resumes from
that checkpoint exactly.

A signal reaches the ranks at different moments (or only some of them), so after each step they agree
whether any was told to stop (one all-reduce of a flag) and stop together after the same step. The driver
imports this module for `Preempted` alone: torch is imported only where a rank asks.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)
EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
    """Raised after the checkpoint of step `step` was written because SIGTERM arrived."""

    def __init__(self, step: int, checkpoint: str):
        super().__init__(f"preempted (SIGTERM): checkpoint of step {step} written to {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


class Watch:
    """Notes SIGTERM while installed (see `watch`); `requested()` asks every rank whether one was told."""

    def __init__(self):
        self.received: float | None = None
        self.group = None  # the ranks' CPU group for the flag, made on first use (every rank makes it)

    def _note(self, signum, frame) -> None:
        if self.received is None:
            self.received = time.monotonic()
            log.warning("SIGTERM: finishing this step, then writing a checkpoint and exiting with %d", EXIT_CODE)

    def requested(self) -> bool:
        """Whether any rank has received SIGTERM (a collective: every rank calls it after the same step). The
        flag goes through a gloo group on the CPU, so that asking never waits for the GPU's queued work."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self.group is None:
                self.group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


@contextlib.contextmanager
def watch() -> Iterator[Watch]:
    """Note SIGTERM instead of dying of it, for the duration; the previous handler comes back after. Off
    the main thread (where Python cannot set handlers) nothing is installed and no stop is ever requested."""
    w = Watch()
    if threading.current_thread() is not threading.main_thread():
        yield w
        return
    previous = signal.signal(signal.SIGTERM, w._note)
    try:
        yield w
    finally:
        signal.signal(signal.SIGTERM, previous)
