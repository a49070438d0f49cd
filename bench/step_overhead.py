"""Framework overhead per step: `python -m trainer.worker` against a minimal hand-written loop.

Both train the same model (the `debug` preset by default) on batches of the same shape with AdamW and
gradient clipping, on this machine's CPU or first GPU. The worker's step time is the median wall-clock
gap between consecutive steps in its metrics.jsonl, so data loading, metrics, logging and the progress
bar all count against it. The hand loop runs before and after the worker, and their mean is the baseline.

    python bench/step_overhead.py [--steps 40] [--warmup 5] [override ...]
"""

from __future__ import annotations

import argparse
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
from hydra import compose, initialize_config_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trainer import config, models  # noqa: E402
from trainer.__main__ import prepare_run  # noqa: E402


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
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, shape, generator=gen).to(device)
        tic = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - tic)
    return statistics.median(times[warmup:])


def worker(overrides: list[str], steps: int, warmup: int, run_dir: str):
    config.register()
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"train.max_steps={steps}",
                                           f"train.eval_every={steps}", f"train.checkpoint_every={steps * 10}",
                                           "train.resume=never"])
    cfg.run_dir = run_dir
    run = prepare_run(cfg)
    subprocess.run([sys.executable, "-m", "trainer.worker", run.config_path], check=True, cwd=REPO,
                   stderr=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        elapsed = [json.loads(line)["elapsed_s"] for line in f]
    gaps = [b - a for a, b in itertools.pairwise(elapsed)]
    return statistics.median(gaps[warmup:]), cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config.register()
        with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
            cfg = compose("config", overrides=args.overrides)
        before = hand_loop(cfg, args.steps, args.warmup)
        framework, cfg = worker(args.overrides, args.steps, args.warmup, os.path.join(tmp, "run"))
        after = hand_loop(cfg, args.steps, args.warmup)
    baseline = (before + after) / 2
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    rows = [("hand-written loop (before)", before), ("python -m trainer.worker", framework),
            ("hand-written loop (after)", after)]
    print(f"\nmodel={cfg.model.name} batch={cfg.train.global_batch_size}x{cfg.data.seq_len} "
          f"device={'cuda' if torch.cuda.is_available() else 'cpu'} threads={torch.get_num_threads()} "
          f"steps={args.steps} (median after {args.warmup})")
    print(f"{'loop':<30}{'step ms':>10}{'tokens/s':>12}")
    for name, t in rows:
        print(f"{name:<30}{t * 1e3:>10.1f}{tokens / t:>12.0f}")
    print(f"framework overhead: {100 * (framework / baseline - 1):+.2f}% (target < 3%)")


if __name__ == "__main__":
    main()
