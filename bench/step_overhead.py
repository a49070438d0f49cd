"""Framework overhead per step: `python -m trainer.worker` against a minimal hand-written loop, for the
`debug` and `small` models.

Both train the same model on batches of the same shape with AdamW and gradient clipping, on this
machine's CPU or first GPU (bf16 autocast there, as the worker's `mixed_precision=auto`). The worker runs
with its default metrics interval (a line every 10 steps, the only place it waits for the device), so
data loading, metrics, logging and the progress bar all count against it; the hand loop moves each batch
to the device and steps, and waits for the device where the worker writes a line. Each reports the median
over those 10-step intervals after the warmup (robust to a shared, busy machine) of the time per step. The
hand loop runs before and after the worker, and their mean is the baseline.

    python bench/step_overhead.py [--models debug,small] [--steps 50] [--warmup 10] [override ...]
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

LOG_EVERY = 10  # the worker's default train.log_every
REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

from trainer import models  # noqa: E402
from trainer.__main__ import prepare_run  # noqa: E402
from trainer.config.compose import compose as compose_config  # noqa: E402
from trainjob.run_files import RunDir  # noqa: E402


def hand_loop(cfg, steps: int, warmup: int) -> float:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        model = models.build(cfg.model)
    shapes = models.param_shapes(model)
    model.to_empty(device=device)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    models.init_weights(model, shapes, 0, cfg.model.init_std, cfg.model.n_layers)
    torch.distributed.destroy_process_group()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.train.global_batch_size, cfg.data.seq_len + 1)
    batches = [torch.randint(0, 256, shape, generator=gen, dtype=torch.int32) for _ in range(8)]
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    marks = []
    for step in range(steps):
        if step >= warmup and (step - warmup) % LOG_EVERY == 0:
            sync(device)  # where the worker's metrics line waits
            marks.append((step, time.perf_counter()))
        tokens = batches[step % len(batches)].to(device, non_blocking=True).long()
        with autocast:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    marks.append((steps, time.perf_counter()))
    return median_step(marks)


def median_step(marks: list[tuple[int, float]]) -> float:
    """The median over intervals of the time per step, from (step, time) marks: robust to a busy machine."""
    return statistics.median((t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(marks))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(overrides: list[str], steps: int, warmup: int, run_dir: str) -> float:
    cfg = compose_config([*overrides, f"train.max_steps={steps}", f"train.eval_every={steps}",
                          f"train.log_every={LOG_EVERY}",
                          f"train.checkpoint_every={steps * 10}", "train.resume=never"])
    cfg.run_dir = run_dir
    run = prepare_run(cfg)
    subprocess.run([sys.executable, "-m", "trainer.worker", run.spec.config_path], check=True, cwd=REPO,
                   stderr=subprocess.DEVNULL)
    with open(RunDir.of(run_dir).metrics) as f:
        lines = [json.loads(line) for line in f]
    marks = [(m["step"], m["elapsed_s"]) for m in lines if m["step"] >= warmup]
    if len(marks) < 2:
        raise SystemExit(f"--steps {steps} leaves fewer than two metrics lines after --warmup {warmup}")
    return median_step(marks)


def measure(model: str, overrides: list[str], steps: int, warmup: int) -> None:
    overrides = [f"model={model}", *overrides]
    cfg = compose_config(overrides)
    before = hand_loop(cfg, steps, warmup)
    with tempfile.TemporaryDirectory() as tmp:
        framework = worker(overrides, steps, warmup, os.path.join(tmp, "run"))
    after = hand_loop(cfg, steps, warmup)
    baseline = (before + after) / 2
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    print(f"\nmodel={model} batch={cfg.train.global_batch_size}x{cfg.data.seq_len} "
          f"device={'cuda' if torch.cuda.is_available() else 'cpu'} threads={torch.get_num_threads()} "
          f"steps={steps} (timed after {warmup})")
    print(f"{'loop':<30}{'step ms':>10}{'tokens/s':>12}")
    for name, t in [("hand-written loop (before)", before), ("python -m trainer.worker", framework),
                    ("hand-written loop (after)", after)]:
        print(f"{name:<30}{t * 1e3:>10.1f}{tokens / t:>12.0f}")
    print(f"framework overhead: {100 * (framework / baseline - 1):+.2f}% (target < 3%)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="debug,small")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    for model in args.models.split(","):
        measure(model, args.overrides, args.steps, args.warmup)


if __name__ == "__main__":
    main()
