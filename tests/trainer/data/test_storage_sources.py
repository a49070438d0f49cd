"""`data.path` as a URL (`trainer.data.sources`): a `data=parquet` corpus built from `s3://<bucket>/corpus/*.parquet`
on moto's S3 server on loopback holds the rows the same files give from local disk; its fingerprint names each
object's URL, size and ETag (the same wherever the copy lies), so a changed object builds a new corpus; and a cache
node given the URL reads it itself, into its own cache, and builds the corpus the driver checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, process_environment
from trainer.data import corpus
from trainjob.allocator import HUGE_PAGES, huge_pages_environment, libc, thp_mode
from trainjob.nodes import free_port

TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 7) for i in range(120)]


def _data(path: str, cache: str, fingerprint: str | None = None):
    return types.SimpleNamespace(name="parquet", seq_len=32, eval_percent=10.0, path=path, text_column="text",
                                 tokens_column=None, cache_dir=cache, fingerprint=fingerprint)


def _rows(built: str) -> dict[str, list]:
    return {split: pq.read_table(os.path.join(built, split)).to_pylist() for split in ("train", "eval")}


@pytest.fixture
def parquet_in_bucket(s3, tmp_path):
    local = tmp_path / "corpus"
    local.mkdir()
    for part in range(3):
        pq.write_table(pa.table({"text": TEXTS[part::3]}), local / f"part-{part}.parquet")
    s3.upload_dir(str(local), "corpus")
    return str(local), s3.url("corpus/*.parquet")


def test_a_corpus_from_a_bucket_holds_the_local_files_rows_and_names_their_etags(s3, parquet_in_bucket, tmp_path):
    local, url = parquet_in_bucket
    from_disk = corpus.prepare(_data(f"{local}/*.parquet", str(tmp_path / "a")))
    from_s3 = corpus.prepare(_data(url, str(tmp_path / "b")))
    assert _rows(from_s3) == _rows(from_disk) and len(_rows(from_s3)["train"]) > 0
    with open(os.path.join(from_s3, "corpus.json")) as f:
        files = json.load(f)["source"]["files"]
    etags = [s3.client().head_object(Bucket=s3.bucket, Key=f"corpus/part-{i}.parquet")["ETag"].strip('"')
             for i in range(3)]
    assert files == [[f"{url}#part-{i}.parquet", os.path.getsize(f"{local}/part-{i}.parquet"), etags[i]]
                     for i in range(3)]
    # The same objects through another cache: the same key. A changed object: a new corpus.
    assert corpus.prepare(_data(url, str(tmp_path / "c"))).endswith(os.path.basename(from_s3))
    pq.write_table(pa.table({"text": TEXTS[:5]}), f"{local}/part-0.parquet")
    s3.client().upload_file(f"{local}/part-0.parquet", s3.bucket, "corpus/part-0.parquet")
    changed = corpus.prepare(_data(url, str(tmp_path / "b")))
    assert changed != from_s3 and _rows(changed) == _rows(corpus.prepare(_data(f"{local}/*.parquet",
                                                                                str(tmp_path / "a"))))


def test_a_cache_node_reads_the_url_itself(s3, parquet_in_bucket, tmp_path):
    _, url = parquet_in_bucket
    checked = corpus.prepare(_data(url, str(tmp_path / "driver")))  # what the driver built and pinned
    node_cache = tmp_path / "node"  # the node's own machine: nothing there
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"data": vars(_data(url, str(node_cache), corpus.corpus_key(checked)))}))
    port = free_port()
    node = subprocess.Popen([sys.executable, "-m", "trainer.data.cache_node", str(config), "--shard", "0/1",
                             "--port", str(port)], cwd=REPO, env={**os.environ, **s3.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = node.stdout.readline()
        assert line.startswith(f"serving grpc+tcp://127.0.0.1:{port}"), node.stderr.read() if node.poll() else line
        tunables = process_environment(node.pid).get("GLIBC_TUNABLES", "")
        # Run again with huge pages for its table (trainjob.allocator), where this machine gives them on request.
        restarts = huge_pages_environment({**os.environ, **s3.env}, thp_mode(), libc()) is not None
        assert (HUGE_PAGES in tunables) == restarts
    finally:
        node.terminate()
        node.wait(timeout=60)
    built = node_cache / "corpus" / os.path.basename(checked)
    assert _rows(str(built)) == _rows(checked)
    assert os.listdir(node_cache / "storage" / "s3")  # its own copy of the objects
