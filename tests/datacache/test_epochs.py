"""One `iter()` is one epoch unless `loop=True`, for `StreamingDataset` (a real node on loopback) and
`LocalDataset`; `LocalDataset` takes `StreamingDataset`'s arguments and yields the same batches.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from datacache import CacheServer, LocalDataset, StreamingDataset


def _write(path, rows: int, first: int = 0) -> str:
    """`id` int64 and `tokens` fixed_size_list<int32>[16], row i holding first + i everywhere."""
    ids = np.arange(first, first + rows, dtype=np.int64)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids.astype(np.int32), 16)), 16)
    pq.write_table(pa.table({"id": ids, "tokens": tokens}), path, row_group_size=3000)
    return str(path)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("epochs") / "rows.parquet", 24_000)


@pytest.fixture(scope="module")
def node(rows):
    server = CacheServer(rows)
    threading.Thread(target=server.serve, daemon=True).start()
    yield server.location
    server.shutdown()


def _datasets(rows, node, **kw):
    return {"streaming": StreamingDataset([node], columns=["id", "tokens"], **kw),
            "local": LocalDataset(rows, columns=["id", "tokens"], **kw)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["streaming", "local"])
def test_a_plain_for_loop_ends_after_one_epoch(rows, node, kind):
    # The reported case: 24,000 rows in batches of 100 is 240 batches, not an endless stream.
    ds = _datasets(rows, node, batch_size=100, seed=3)[kind]
    ids = [batch["id"] for batch in ds]
    assert len(ids) == 240
    assert sorted(np.concatenate(ids).tolist()) == list(range(24_000))
    ds.set_epoch(1)
    again = np.concatenate([batch["id"] for batch in ds])
    assert again.tolist() == ds.plan.epoch_order(1).tolist()  # set_epoch: the next epoch's order, once


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["streaming", "local"])
def test_loop_true_goes_on_epoch_after_epoch(rows, node, kind):
    ds = _datasets(rows, node, batch_size=1000, seed=3, loop=True)[kind]
    ids = np.concatenate([b["id"] for b in itertools.islice(ds, 72)])  # three epochs of 24 batches
    assert ids.tolist() == np.concatenate([ds.plan.epoch_order(e) for e in range(3)]).tolist()


@pytest.mark.timeout(60)
def test_local_dataset_takes_streaming_datasets_arguments_and_gives_its_batches(rows, node):
    for kw in (dict(batch_size=50, rank=1, world_size=2), dict(global_batch_size=100, rank=1, world_size=2)):
        ds = _datasets(rows, node, shuffle=True, seed=9, **kw)
        streamed, local = (list(ds[k]) for k in ("streaming", "local"))
        assert len(streamed) == len(local) == 240
        for a, b in zip(streamed, local, strict=True):
            assert a.keys() == b.keys() == {"id", "tokens"}
            for c in a:
                assert a[c].dtype == b[c].dtype and a[c].shape == b[c].shape and torch.equal(a[c], b[c])
    assert LocalDataset(rows, batch_size=8).columns == ["tokens"]  # the same default column


@pytest.mark.timeout(60)
def test_local_dataset_reads_a_glob_or_a_list_of_files_in_order(tmp_path):
    a, b = _write(tmp_path / "a.parquet", 30), _write(tmp_path / "b.parquet", 20, first=30)
    for paths in (str(tmp_path / "*.parquet"), [a, b], str(tmp_path)):
        ds = LocalDataset(paths, columns=["id"], batch_size=10, shuffle=False)
        assert np.concatenate([x["id"] for x in ds]).tolist() == list(range(50))


def test_local_dataset_refuses_bad_arguments_clearly(rows, tmp_path):
    with pytest.raises(ValueError, match="give exactly one of batch_size"):
        LocalDataset(rows)
    with pytest.raises(ValueError, match="has no column 'text' \\(it has id, tokens\\)"):
        LocalDataset(rows, columns=["text"], batch_size=8)
    with pytest.raises(TypeError, match="give a list of column names, such as \\['id'\\]"):
        LocalDataset(rows, columns="id", batch_size=8)
    with pytest.raises(FileNotFoundError, match="no Parquet files at"):
        LocalDataset(str(tmp_path / "none-*.parquet"), batch_size=8)
    with pytest.raises(ValueError, match="global_batch_size=9 is not divisible by world_size=2"):
        LocalDataset(rows, global_batch_size=9, world_size=2, rank=0)
