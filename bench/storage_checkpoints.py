"""A checkpoint saved and loaded through an S3 server against local disk (`train.checkpoint_dir`): for each model
preset, in this process (a one-rank gloo group) on the CPU, the model (and its optimizer's state with
`--optim adamw`) saved `--saves` times by `trainer.checkpoint.store.Checkpointer` through DCP's store, as the loop
saves, into a local directory and into `s3://<bucket>/ckpt` on moto's S3 server on loopback (`moto[server]`, in a
thread of this process: the store's own time is in-memory, so the S3 row is the cost of the S3 protocol, fsspec
and HTTP, not of a network or a disk), then loaded back as a resume loads it (`dcp_store.load`, the checkpoint
verified against its manifest first, as `resume.check` does). Medians of the saves after the first (which plans).
`checkpoint_table` returns the rows; `main` prints them.

    python bench/storage_checkpoints.py [--models debug,1b] [--optim sgd] [--saves 3]

The 1b model's weights alone (4 GB; `--optim sgd`) need about 16 GB of memory here: the model, the copy the S3
server keeps, and the load's.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

from trainer import models  # noqa: E402
from trainer.checkpoint import checks, dcp_store, fs, lines, store  # noqa: E402
from trainer.config.compose import compose  # noqa: E402
from trainjob.nodes import LOCALHOST, free_port  # noqa: E402


def _s3_server() -> tuple[object, str]:
    """moto's S3 server on loopback with a bucket, and this process's AWS environment pointed at it; the URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address=LOCALHOST, port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{LOCALHOST}:{port}"})
    boto3.client("s3").create_bucket(Bucket="bench")
    return server, "s3://bench/ckpt"


def _measure(name: str, root: str, args) -> dict:
    torch.manual_seed(0)
    model = models.build(compose([f"model={name}"]).model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if args.optim == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=1e-4)
    model(torch.randint(0, 256, (1, 9))).float().mean().backward()
    optimizer.step()
    dcp = dcp_store.DCPStore(model, optimizer, torch.device("cpu"), False)
    saver = store.Checkpointer(root, SimpleNamespace(checkpoint_every=1, max_steps=10**6, keep_latest_k=1), dcp,
                               lambda: {"step": 0})
    saves = []
    for i in range(args.saves):
        start = time.perf_counter()
        saver.save(i + 1)
        saves.append(time.perf_counter() - start)
    path = lines.latest(root)
    size = sum(fs.getsize(os.path.join(path, n)) for n in fs.listdir(path))
    start = time.perf_counter()
    assert checks.damage(path) is None
    dcp.load(path, {"step": 0})
    load = time.perf_counter() - start
    save = statistics.median(saves[1:] or saves)
    return {"model": name, "store": "s3 (moto, loopback)" if fs.remote(root) else "local disk",
            "params": models.num_params(model), "gb": size / 1e9, "save_s": save, "load_s": load,
            "save_gbps": size / 1e9 / save, "load_gbps": size / 1e9 / load}


def checkpoint_table(model_names: list[str], args) -> list[dict]:
    """One row per model and store: save and load seconds, and their GB/s."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    server, url = _s3_server()
    rows = []
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            for name in model_names:
                rows.append(_measure(name, os.path.join(tmp, name), args))
                rows.append(_measure(name, f"{url}/{name}", args))
                fs.rmtree(f"{url}/{name}")
    finally:
        server.stop()
        dist.destroy_process_group()
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<8} {'params':>8} {'store':<20} {'GB':>6} {'save s':>8} {'load s':>8} {'save GB/s':>10} "
          f"{'load GB/s':>10}")
    for r in rows:
        print(f"{r['model']:<8} {r['params'] / 1e6:>7.1f}M {r['store']:<20} {r['gb']:>6.3f} {r['save_s']:>8.2f} "
              f"{r['load_s']:>8.2f} {r['save_gbps']:>10.3f} {r['load_gbps']:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="debug,small")
    parser.add_argument("--optim", default="sgd", choices=("adamw", "sgd"),
                        help="sgd: no optimizer state, the checkpoint holds the model's weights alone")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default=None, help="the local checkpoints' directory (default: a temporary one)")
    args = parser.parse_args()
    print_table(checkpoint_table(args.models.split(","), args))


if __name__ == "__main__":
    main()
