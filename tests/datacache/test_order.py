"""The global batch order: every row once per epoch for any world size and worker count; exact positions."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from datacache import BatchPlan, LocalDataset
from tests.conftest import examples


@pytest.fixture(scope="module")
def rows_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.parquet"
    ids = np.repeat(np.arange(103, dtype=np.uint16), 4)  # row i holds the token i four times
    pq.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(ids), 4)}), path)
    return str(path)


def _epoch(rows_path, world, workers, global_batch, shuffle=True, start=0):
    per_rank = []
    for rank in range(world):
        ds = LocalDataset(rows_path, global_batch_size=global_batch, shuffle=shuffle, seed=7, rank=rank,
                          world_size=world)
        ds.set_position(0, start)
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        per_rank.append([b["tokens"][:, 0].tolist() for b in loader])
    return per_rank


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 0), (2, 2), (4, 3)])
def test_each_row_once_per_epoch_and_same_batch_count_on_every_rank(rows_path, world, workers):
    per_rank = _epoch(rows_path, world, workers, global_batch=8)
    assert len({len(batches) for batches in per_rank}) == 1
    seen = [row for batches in per_rank for batch in batches for row in batch]
    assert len(seen) == len(set(seen)) == (103 // 8) * 8


def test_global_batches_do_not_depend_on_world_size_or_workers(rows_path):
    one = _epoch(rows_path, 1, 0, 8)[0]
    two = _epoch(rows_path, 2, 2, 8)
    assert [a + b for a, b in zip(*two, strict=True)] == one


def test_resume_mid_epoch_continues_with_exactly_the_rest(rows_path):
    full = _epoch(rows_path, 1, 0, 8)[0]
    rest = _epoch(rows_path, 2, 1, 8, start=5)
    assert [a + b for a, b in zip(*rest, strict=True)] == full[5:]


def test_epochs_reshuffle_deterministically():
    plan = BatchPlan(num_rows=50, global_batch_size=5, seed=3)
    assert not np.array_equal(plan.epoch_order(0), plan.epoch_order(1))
    assert np.array_equal(plan.epoch_order(1), BatchPlan(50, 5, seed=3).epoch_order(1))
    assert plan.position(23) == (2, 3)
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        BatchPlan(50, 5, world_size=3)


@settings(max_examples=examples(60))
@given(rows=st.integers(1, 70), world=st.sampled_from([1, 2, 3, 4]), per_rank=st.integers(1, 9),
       shuffle=st.booleans(), drop_last=st.booleans(), block_rows=st.integers(1, 5), epoch=st.integers(0, 3))
@pytest.mark.timeout(60)
def test_any_plan_gives_full_batches_with_every_row_once_or_refuses(rows, world, per_rank, shuffle, drop_last,
                                                                      block_rows, epoch):
    global_batch = world * per_rank
    if drop_last and rows < global_batch:
        with pytest.raises(ValueError, match=f"{rows} rows make no global batch of {global_batch}"):
            BatchPlan(rows, global_batch, world, 0, shuffle, 1, block_rows, 2, drop_last)
        return
    plans = [BatchPlan(rows, global_batch, world, r, shuffle, 1, block_rows, 2, drop_last) for r in range(world)]
    order = plans[0].epoch_order(epoch)
    batches = [np.concatenate([p.rows(order, s) for p in plans]) for s in range(plans[0].batches_per_epoch)]
    assert all(len(b) == global_batch for b in batches)
    seen = np.concatenate(batches)
    if drop_last:
        assert len(seen) == len(set(seen.tolist())) == (rows // global_batch) * global_batch
    else:
        assert set(seen.tolist()) == set(range(rows))  # every row, padded up to whole batches
        assert len(seen) == -(-rows // global_batch) * global_batch
        assert sorted(seen[:rows].tolist()) == list(range(rows))  # each row once before any repeats
