"""Storage through an S3 server against local disk, side by side: the same `data=parquet` corpus (`--files`
Parquet files of `--mb` MiB of text in all) built by `trainer.data.corpus.prepare` from a local glob and from
`s3://<bucket>/corpus/*.parquet` on moto's S3 server on loopback (`moto[server]`, started here in a process of
its own: the figures are an S3 client's and server's on one machine, not a network's). Each row is timed `--rounds`
times (the median shown), each round in a fresh cache:

- the first build: local, the Parquet read and tokenized; S3, the objects listed (with their ETags), fetched into
  the storage cache through pyarrow's S3 filesystem, then read and tokenized the same;
- the second build, the same source again: the corpus found in the cache (local: the files' sizes and times
  read; S3: the objects listed, their copy found, nothing fetched);
- a changed object: one file rewritten, the corpus built again (S3: that version's objects fetched again).

ROWS holds one function per row, each returning (local seconds, S3 seconds).

Then, for each model preset of `--models`, a checkpoint saved and loaded through the same server against local
disk (`train.checkpoint_dir`): in this process (a one-rank gloo group) on the CPU, the model (and its optimizer's
state with `--optim adamw`) saved `--saves` times by `trainer.checkpoint.store.Checkpointer` through DCP's store, as
the loop saves, into a local directory and into `s3://bench/ckpt`, then loaded back as a resume loads it
(`dcp_store.load`, the checkpoint verified against its manifest first, as `resume.check` does). Medians of the saves
after the first (which plans). The S3 rows are the cost of the S3 protocol, fsspec, HTTP and moto's server (which
joins a multipart upload's parts in memory and reads a whole object for each ranged GET), not of a network.

    python bench/storage.py [--files 8] [--mb 32] [--rounds 3] [--models debug,small] [--optim sgd] [--saves 3]
                            [--threads 1]

`--threads` is `train.checkpoint_threads` (DCP's thread_count): the files a rank writes at once, for both rows.

The 1b model's weights alone (4 GB; `--optim sgd`) are one 4 GB object with `--threads 1`, which moto's server
holds two or three times while it joins the parts: give `--threads 8` there (objects of ~0.5 GB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ off the path: its scripts' names are installed packages' (tests/bench/test_script_path.py).
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
               "AWS_DEFAULT_REGION": "us-east-1"}


def _server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a process of its own (`python -m moto.server`), so that it shares no interpreter lock
    with the client's threads; its endpoint once it answers."""
    import urllib.error
    import urllib.request

    from trainjob.nodes import LOCALHOST, free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", LOCALHOST, "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://{LOCALHOST}:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=5).close()
            return server, endpoint
        except (urllib.error.URLError, OSError):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto's S3 server did not answer at {endpoint}") from None
            time.sleep(0.2)


def _write_parquet(folder: str, files: int, mb: float, seed: int = 0) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    words = [bytes(rng.integers(97, 123, size=n)).decode() for n in rng.integers(2, 10, size=4096)]
    per_file = int(mb * 2**20 / files)
    os.makedirs(folder, exist_ok=True)
    for i in range(files):
        docs, size = [], 0
        while size < per_file:
            doc = " ".join(rng.choice(words, size=int(rng.integers(50, 400))))
            docs.append(doc)
            size += len(doc)
        pq.write_table(pa.table({"text": docs}), os.path.join(folder, f"part-{i:03d}.parquet"))


def _data(path: str, cache: str):
    return types.SimpleNamespace(name="parquet", seq_len=512, eval_percent=None, path=path, text_column="text",
                                 tokens_column=None, cache_dir=cache, fingerprint=None)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Sources:
    """The same Parquet files on local disk and in a bucket; a fresh cache per round."""

    def __init__(self, root: str, endpoint: str, files: int, mb: float):
        import boto3

        self.root, self.local = root, os.path.join(root, "corpus")
        _write_parquet(self.local, files, mb)
        self.bucket = f"bench-{uuid.uuid4().hex[:8]}"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        self.client.create_bucket(Bucket=self.bucket)
        for name in sorted(os.listdir(self.local)):
            self.client.upload_file(os.path.join(self.local, name), self.bucket, f"corpus/{name}")
        self.bytes = sum(os.path.getsize(os.path.join(self.local, n)) for n in os.listdir(self.local))

    def build(self, where: str, cache: str) -> None:
        from trainer.data import corpus

        path = f"{self.local}/*.parquet" if where == "local" else f"s3://{self.bucket}/corpus/*.parquet"
        corpus.prepare(_data(path, cache))

    def change_one(self, seed: int) -> None:
        """Rewrite the first file, locally and in the bucket: a new size and time, a new ETag."""
        folder = os.path.join(self.root, f"changed-{seed}")
        _write_parquet(folder, 1, 0.25, seed=seed)
        first = sorted(os.listdir(self.local))[0]
        shutil.copy(os.path.join(folder, "part-000.parquet"), os.path.join(self.local, first))
        self.client.upload_file(os.path.join(self.local, first), self.bucket, f"corpus/{first}")


def _first_build(src: Sources, cache: str) -> tuple[float, float]:
    return _timed(lambda: src.build("local", cache + "-local")), _timed(lambda: src.build("s3", cache + "-s3"))


def _second_build(src: Sources, cache: str) -> tuple[float, float]:
    src.build("local", cache + "-local")
    src.build("s3", cache + "-s3")
    return _first_build(src, cache)


def _changed_object(src: Sources, cache: str) -> tuple[float, float]:
    src.build("local", cache + "-local")
    src.build("s3", cache + "-s3")
    src.change_one(seed=len(os.listdir(src.root)))
    return _first_build(src, cache)


def _checkpoint_row(name: str, root: str, args) -> dict:
    """A checkpoint of model preset `name` saved and loaded under `root` (a directory or an s3:// URL)."""
    import torch

    from trainer import models
    from trainer.checkpoint import checks, dcp_store, fs, lines, store
    from trainer.config.compose import compose

    torch.manual_seed(0)
    model = models.build(compose([f"model={name}"]).model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if args.optim == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=1e-4)
    model(torch.randint(0, 256, (1, 9))).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # a checkpoint holds no gradients: nor does the memory here
    dcp = dcp_store.DCPStore(model, optimizer, torch.device("cpu"), False, args.threads)
    saver = store.Checkpointer(root, types.SimpleNamespace(checkpoint_every=1, max_steps=10**6, keep_latest_k=1),
                               dcp, lambda: {"step": 0})
    saves = []
    for i in range(args.saves):
        saves.append(_timed(lambda step=i + 1: saver.save(step)))
    path = lines.latest(root)
    size = sum(fs.getsize(os.path.join(path, n)) for n in fs.listdir(path))
    start = time.perf_counter()
    assert checks.damage(path) is None
    dcp.load(path, {"step": 0})
    load = time.perf_counter() - start
    save = statistics.median(saves[1:] or saves)
    return {"model": name, "store": "S3 (moto, loopback)" if fs.remote(root) else "local disk",
            "params": models.num_params(model), "gb": size / 1e9, "save_s": save, "load_s": load}


def _checkpoints(args, root: str) -> None:
    import boto3
    import torch.distributed as dist

    from trainer.checkpoint import fs

    boto3.client("s3").create_bucket(Bucket="bench")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print(f"\ntrain.checkpoint_threads={args.threads}, optimizer {args.optim}")
    print(f"| {'model':<8} | {'params':>8} | {'store':<20} | {'GB':>6} | {'save s':>7} | {'load s':>7} | "
          f"{'save GB/s':>9} | {'load GB/s':>9} |")
    print("|" + "|".join("-" * (w + 2) for w in (8, 8, 20, 6, 7, 7, 9, 9)) + "|")
    try:
        for name in args.models.split(","):
            for where in (os.path.join(root, "ckpt", name), f"s3://bench/ckpt/{name}"):
                r = _checkpoint_row(name, where, args)
                print(f"| {name:<8} | {r['params'] / 1e6:>7.1f}M | {r['store']:<20} | {r['gb']:>6.3f} | "
                      f"{r['save_s']:>7.2f} | {r['load_s']:>7.2f} | {r['gb'] / r['save_s']:>9.3f} | "
                      f"{r['gb'] / r['load_s']:>9.3f} |", flush=True)
                fs.rmtree(where)
    finally:
        dist.destroy_process_group()


ROWS = [("corpus: first build", _first_build), ("corpus: second build (cached)", _second_build),
        ("corpus: one object changed", _changed_object)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mb", type=float, default=32.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="debug,small", help="the checkpoints' model presets ('' for none)")
    parser.add_argument("--optim", default="sgd", choices=("adamw", "sgd"),
                        help="sgd: no optimizer state, the checkpoint holds the model's weights alone")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="train.checkpoint_threads: files a rank writes at once")
    args = parser.parse_args(argv)
    server, endpoint = _server()
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    os.environ.pop("TRAINJOB_STORAGE_CACHE", None)
    root = tempfile.mkdtemp(prefix="bench-storage-")
    try:
        src = Sources(root, endpoint, args.files, args.mb)
        print(f"{args.files} Parquet files, {src.bytes / 2**20:.1f} MiB; S3: moto's server on loopback; "
              f"median of {args.rounds} rounds")
        print(f"| {'what':<32} | {'local disk s':>12} | {'S3 s':>8} | {'S3 / local':>10} |")
        print(f"|{'-' * 34}|{'-' * 14}|{'-' * 10}|{'-' * 12}|")
        for name, row in ROWS:
            times = [row(src, os.path.join(root, f"cache-{name[:6]}-{r}-{uuid.uuid4().hex[:6]}"))
                     for r in range(args.rounds)]
            local = statistics.median(t[0] for t in times)
            s3 = statistics.median(t[1] for t in times)
            print(f"| {name:<32} | {local:>12.3f} | {s3:>8.3f} | {s3 / local:>10.2f} |", flush=True)
        if args.models:
            _checkpoints(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
