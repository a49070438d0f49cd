"""The training stall of one checkpoint save, synchronous against `train.checkpoint_async=true`.

For each model preset, in this process (a one-rank group) on this machine's first GPU or its CPU: the model
and an AdamW state (one step taken), saved by `trainer.checkpoint.store.Checkpointer` through DCP's store as the
loop saves, `--saves` times with `--steps` training steps (forward, backward, optimizer) between saves. The stall
is the time the loop spends in `save()`: the whole write when synchronous; with async the copy of the state to CPU
memory (pinned on a GPU) and the wait, if any, for the previous write. `write s` is the time from a save's start
until its checkpoint is renamed whole (async: measured by waiting at once, after the timed saves). The first save
of each mode is not counted (the staging buffers and the DCP plan are made there).

Each is measured with the checkpoint's manifest (every file's size and XXH3-128 hash, hashed as it is written:
`trainer.checkpoint.manifest`) and without (`trainer.checkpoint.manifest.HASH_FILES` off: DCP's own writer, no
manifest), `--rounds` times in turn (off then on, on then off, ...), so that the machine's other load and a disk's
drift fall on both alike; the medians are shown, and `hash +%` is what hashing adds to the write (and to the stall) of
the same model and mode. A busy disk (fsync) makes those differences noisy; `hash s` is the hashing itself, the
CPU time XXH3-128 takes over the bytes of the checkpoint (read into memory first), which is what hashing while
writing adds to a save, and `hash/write` that time against the write without hashing. `save CPU s` is the
CPU time of the saving process (all its threads) over the stall (synchronous: the whole write), which a busy
disk or a busy machine hardly moves, and `+CPU/write` what hashing adds to it against the write without
hashing: on a shared machine, the steadiest measure of what the manifest costs a save, end to end.

    python bench/checkpoint.py [--models debug,small] [--modes sync,async] [--saves 4] [--steps 3] [--seq 256]
        [--batch 4] [--rounds 1]

The 1b model's state (its weights, 4 GB; with AdamW's too, 12 GB, it needs 20 GB of memory) on a CPU,
synchronous saves only:

    python bench/checkpoint.py --models 1b --optim sgd --modes sync --saves 3 --steps 0 --seq 8 --batch 1 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
import xxhash

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

from trainer import models  # noqa: E402
from trainer.checkpoint import dcp_store, lines, manifest, store  # noqa: E402
from trainer.config.compose import compose  # noqa: E402


def model_config(name: str):
    return compose([f"model={name}"]).model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(model, optimizer, tokens: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure(name: str, background: bool, hashed: bool, args, device: torch.device, root: str) -> dict:
    manifest.HASH_FILES = hashed
    torch.manual_seed(0)
    model = models.build(model_config(name)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True) if args.optim == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=1e-4)  # no state: the checkpoint holds the model's weights
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), device=device)
    train_steps(model, optimizer, tokens, 1)
    train = SimpleNamespace(checkpoint_every=1, max_steps=10**6, keep_latest_k=1)
    saver = store.Checkpointer(root, train, dcp_store.DCPStore(model, optimizer, device, background),
                               lambda: {"step": 0})
    stalls, writes, cpus = [], [], []
    for i in range(args.saves):
        sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        saver.save(i + 1)
        sync(device)
        stalls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        if not background:
            writes.append(stalls[-1])
        train_steps(model, optimizer, tokens, args.steps)
    saver.finish()
    for i in range(2):  # async: the time until the checkpoint is whole, waiting at once
        start = time.perf_counter()
        saver = store.Checkpointer(root, train, dcp_store.DCPStore(model, optimizer, device, background),
                                   lambda: {"step": 0})
        saver.save(args.saves + i + 1)
        saver.finish()
        if background and i:
            writes.append(time.perf_counter() - start)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    hashing = hash_seconds(lines.latest(root)) if hashed else 0.0
    return {"model": name, "params": models.num_params(model), "mode": "async" if background else "sync",
            "hash": hashed, "hash_s": hashing, "stall": statistics.median(stalls[1:]), "first": stalls[0],
            "cpu": statistics.median(cpus[1:]),
            "write": statistics.median(writes[1:] or writes), "gb": size / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="debug,small")
    parser.add_argument("--modes", default="sync,async", help="sync, async or both")
    parser.add_argument("--optim", default="adamw", choices=("adamw", "sgd"),
                        help="sgd: no optimizer state, the checkpoint holds the model's weights alone")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measurements of each row, hashing off and on in turn, the order swapped each round")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in args.models.split(","):
            for background in [m == "async" for m in args.modes.split(",")]:
                rounds = {False: [], True: []}
                for i in range(args.rounds):
                    for hashed in (False, True) if i % 2 == 0 else (True, False):  # a drifting disk falls on both
                        root = os.path.join(tmp, f"{name}-{background}-{hashed}")
                        rounds[hashed].append(measure(name, background, hashed, args, device, root))
                        shutil.rmtree(root, ignore_errors=True)
                        r = rounds[hashed][-1]
                        print(f"measured {name} {r['mode']} hash={hashed}: stall {r['stall']:.3f} s, write "
                              f"{r['write']:.3f} s", file=sys.stderr, flush=True)
                rows += [median_row(rounds[hashed]) for hashed in (False, True)]
    dist.destroy_process_group()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\ncheckpoint stall per save on {where}, {args.steps} steps between saves")
    print(f"{'model':<8}{'params':>14}{'mode':>7}{'hash':>6}{'stall s':>10}{'first s':>10}{'write s':>10}"
          f"{'ckpt GB':>9}{'stall vs sync':>15}{'hash +% write':>15}{'hash +% stall':>15}{'hash s':>9}"
          f"{'hash/write':>12}{'save CPU s':>12}{'+CPU/write':>12}")
    sync_stall, plain = {}, {}
    for r in rows:
        sync_stall.setdefault((r["model"], r["hash"]), r["stall"])
        plain.setdefault((r["model"], r["mode"]), r)
        ratio = r["stall"] / sync_stall[r["model"], r["hash"]]
        base = plain[r["model"], r["mode"]]
        print(f"{r['model']:<8}{r['params']:>14,}{r['mode']:>7}{'on' if r['hash'] else 'off':>6}{r['stall']:>10.3f}"
              f"{r['first']:>10.3f}{r['write']:>10.3f}{r['gb']:>9.2f}{ratio:>14.2f}x"
              f"{100 * (r['write'] / base['write'] - 1):>+14.1f}%{100 * (r['stall'] / base['stall'] - 1):>+14.1f}%"
              f"{r['hash_s']:>9.3f}{100 * r['hash_s'] / base['write']:>11.2f}%{r['cpu']:>12.3f}"
              f"{100 * (r['cpu'] - base['cpu']) / base['write']:>+11.2f}%")


def hash_seconds(directory: str) -> float:
    """The CPU time of hashing the files of checkpoint `directory` as a save does, their reading not counted."""
    spent = 0.0
    for name in os.listdir(directory):
        h = xxhash.xxh3_128()
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(64 << 20):
                start = time.perf_counter()
                h.update(chunk)
                spent += time.perf_counter() - start
    return spent


def median_row(rounds: list[dict]) -> dict:
    """One row of the table: each time the median over the rounds."""
    timed = ("stall", "first", "write", "hash_s", "cpu")
    return {**rounds[0], **{k: statistics.median(r[k] for r in rounds) for k in timed}}


if __name__ == "__main__":
    main()
