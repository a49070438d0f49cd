"""`StreamingDataset` reads a Kubeflow Trainer cache (`kubeflow+grpc://<head>`): the table's size and layout
from the head, rows from the workers through IndexPair tickets, with its own plan: every row exactly once per
epoch for any world size and worker count, shuffled, the same batches as `LocalDataset`'s over the same
files, resumable mid-epoch. Against `kubeflow_double` (a double of Kubeflow's head and workers written from
the protocol: the Rust server cannot be built here), on loopback, with real DataLoader worker processes.
"""

from __future__ import annotations

import collections
import multiprocessing

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from datacache import DataCacheError, LocalDataset, StreamingDataset
from datacache import kubeflow as kf
from tests.conftest import examples
from tests.datacache.kubeflow_double import KubeflowCache

FILES, PER_FILE = 5, 97  # 485 rows; file i to worker i % 2: each worker holds separate runs of rows
ROWS = FILES * PER_FILE

multiprocessing.set_forkserver_preload(["torch"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root, paths = tmp_path_factory.mktemp("kubeflow-table"), []
    for f in range(FILES):
        ids = np.arange(f * PER_FILE, (f + 1) * PER_FILE, dtype=np.int64)
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids.astype(np.int32), 4)), 4)
        paths.append(str(root / f"part-{f}.parquet"))
        pq.write_table(pa.table({"id": ids, "text": [f"row {i}" for i in ids], "tokens": tokens}), paths[-1])
    return paths


@pytest.fixture(scope="module")
def cache(files):
    double = KubeflowCache(files, workers=2, batch_rows=40)
    yield double
    double.close()


def _dataset(cache, **kw) -> StreamingDataset:
    return StreamingDataset([f"kubeflow+{cache.head}"], columns=["id", "tokens"], retries=1, timeout=10, **kw)


def _epoch(cache, world, workers, global_batch, shuffle, start=0, block_rows=1):
    per_rank = []
    for rank in range(world):
        ds = _dataset(cache, global_batch_size=global_batch, shuffle=shuffle, seed=4, rank=rank, world_size=world,
                      block_rows=block_rows)
        ds.set_position(0, start)
        loader = DataLoader(ds, batch_size=None, num_workers=workers,
                            multiprocessing_context="forkserver" if workers else None, timeout=60 if workers else 0)
        per_rank.append([b["id"].tolist() for b in loader])
    return per_rank


def test_the_layout_is_learned_from_the_head(cache):
    ds = _dataset(cache, batch_size=8)
    ds.describe()
    assert ds.plan.num_rows == ROWS and ds._offsets.tolist() == list(range(0, ROWS + 1, PER_FILE))
    ports = [w.port for w in cache.workers]
    assert [n.endpoint for n in ds._nodes] == [f"grpc://127.0.0.1:{ports[f % 2]}" for f in range(FILES)]
    assert ds.schema.names == ["id", "text", "tokens"]  # the table's, from a worker: not the head's


@pytest.mark.timeout(180)
@settings(max_examples=examples(6), suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(world=st.integers(1, 3), workers=st.sampled_from([0, 2]), per_rank=st.integers(1, 24), shuffle=st.booleans(),
       block_rows=st.sampled_from([1, 16]))
def test_every_row_exactly_once_per_epoch_for_any_world_size_and_workers(cache, world, workers, per_rank, shuffle,
                                                                        block_rows):
    global_batch = per_rank * world
    ranks = _epoch(cache, world, workers, global_batch, shuffle, block_rows=block_rows)
    assert len({len(r) for r in ranks}) == 1 and all(len(b) == per_rank for r in ranks for b in r)
    seen = collections.Counter(i for r in ranks for b in r for i in b)
    assert sum(seen.values()) == (ROWS // global_batch) * global_batch and max(seen.values()) == 1


def test_the_same_batches_as_local_dataset_over_the_same_files(cache, files):
    for shuffle in (False, True):
        local = LocalDataset(files, columns=["id", "tokens"], global_batch_size=20, shuffle=shuffle, seed=4)
        streamed = _dataset(cache, global_batch_size=20, shuffle=shuffle, seed=4)
        for a, b in zip(streamed, local, strict=True):
            assert torch.equal(a["id"], b["id"]) and torch.equal(a["tokens"], b["tokens"])
            assert a["tokens"].dtype == torch.int32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_resumes_mid_epoch_exactly(cache, workers):
    def loader(state=None):
        dl = StatefulDataLoader(_dataset(cache, global_batch_size=8, seed=2), batch_size=None, num_workers=workers,
                                multiprocessing_context="forkserver" if workers else None)
        if state is not None:
            dl.load_state_dict(state)
        return dl

    first = loader()
    it, consumed = iter(first), []
    for _ in range(9):
        consumed += next(it)["id"].tolist()
    rest = [i for b in loader(first.state_dict()) for i in b["id"].tolist()]
    assert len(consumed + rest) == len(set(consumed + rest)) == (ROWS // 8) * 8
    # and with another worker count and world size, from a global step
    done = [i for r in _epoch(cache, 2, 0, 12, True) for b in r[:7] for i in b]
    after = [i for r in _epoch(cache, 3, 2, 12, True, start=7) for b in r for i in b]
    assert len(done + after) == len(set(done + after)) == (ROWS // 12) * 12


def test_clear_errors_for_a_bad_head_or_column(cache, tmp_path):
    with pytest.raises(ValueError, match="give a Kubeflow cache's head alone"):
        StreamingDataset([f"kubeflow+{cache.head}", "grpc://127.0.0.1:1"], batch_size=4)
    with pytest.raises(DataCacheError, match=r"Kubeflow cache worker grpc://127\.0\.0\.1:\d+ has no column label "
                                             r"\(it has id, text, tokens\)"):
        StreamingDataset([f"kubeflow+{cache.head}"], columns=["label"], batch_size=4).describe()
    with pytest.raises(DataCacheError, match=r"cache node grpc://127\.0\.0\.1:9: get_flight_info failed 2 times"):
        StreamingDataset(["kubeflow+grpc://127.0.0.1:9"], batch_size=4, retries=1, backoff=0.01, timeout=2).describe()


def test_the_double_answers_as_kubeflows_head(cache):
    import pyarrow.flight as flight

    client = flight.connect(cache.head)
    with pytest.raises(pa.ArrowInvalid, match="Invalid local_rank value"):
        client.get_flight_info(flight.FlightDescriptor.for_path("x", "2"))
    with pytest.raises(pa.ArrowInvalid, match="out-of-range error, with message: Invalid partition range"):
        client.get_flight_info(flight.FlightDescriptor.for_path(str(ROWS), str(ROWS + 1)))
    info = client.get_flight_info(flight.FlightDescriptor.for_path("1", "4"))  # rows [122, 244): files 1 and 2
    assert [kf.decode_index_pair(e.ticket.ticket) for e in info.endpoints] == [(122, 243)] * 2
