"""Forked DataLoader workers (the default start method): a StreamingDataset connects only where it is
iterated, so `StatefulDataLoader(ds, batch_size=None, num_workers=2)` works as it is, with every row once
per epoch across ranks and workers and an exact resume; iterating in the parent, then forking, is refused
with an error that says what to do. Each case runs in a fresh interpreter (one that never used gRPC
before), against real node processes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.datacache.test_no_hang import endpoint, start, stop, write_rows

ROWS = 203

EPOCH_AND_RESUME = """
import json, sys
import torch.multiprocessing as mp
from torchdata.stateful_dataloader import StatefulDataLoader
import datacache.dataset
from datacache import StreamingDataset

endpoints = sys.argv[1].split(",")
assert mp.get_start_method() == "fork"

def dataset(**kw):
    return StreamingDataset(endpoints, columns=["id"], global_batch_size=8, seed=3, loop=False, **kw)

seen = []
for rank in range(2):
    loader = StatefulDataLoader(dataset(rank=rank, world_size=2), batch_size=None, num_workers=2)
    seen += [i for batch in loader for i in batch["id"].tolist()]

loader = StatefulDataLoader(dataset(), batch_size=None, num_workers=2)
it = iter(loader)
first = [i for _ in range(5) for i in next(it)["id"].tolist()]
state = loader.state_dict()
del it
resumed = StatefulDataLoader(dataset(), batch_size=None, num_workers=2)
resumed.load_state_dict(state)
rest = [i for batch in resumed for i in batch["id"].tolist()]
parent_connected = datacache.dataset._grpc_pid is not None
order = dataset().plan.epoch_order(0)  # only now does this process connect
print(json.dumps({"seen": seen, "first": first, "rest": rest, "order": order.tolist(),
                  "parent_connected": parent_connected}))
"""

PARENT_FIRST = """
import sys
from torchdata.stateful_dataloader import StatefulDataLoader
from datacache import StreamingDataset

ds = StreamingDataset(sys.argv[1].split(","), columns=["id"], global_batch_size=8, loop=False)
next(iter(ds))  # the parent reads a batch, and so connects, before the workers fork
try:
    next(iter(StatefulDataLoader(ds, batch_size=None, num_workers=1, timeout=60)))
except Exception as e:
    print(str(e).splitlines()[-1])
"""


EARLY_CHECKPOINT = """
import json, sys
from torchdata.stateful_dataloader import StatefulDataLoader
from datacache import StreamingDataset

endpoints = sys.argv[1].split(",")

def dataset():
    return StreamingDataset(endpoints, columns=["id"], global_batch_size=8, seed=3, loop=False)

out = {}
for taken in (0, 1, 3):  # checkpoints before every worker has delivered a batch, and after
    loader = StatefulDataLoader(dataset(), batch_size=None, num_workers=2)
    it = iter(loader)
    first = [i for _ in range(taken) for i in next(it)["id"].tolist()]
    state = loader.state_dict()
    del it
    resumed = StatefulDataLoader(dataset(), batch_size=None, num_workers=2)
    resumed.load_state_dict(state)
    out[taken] = first + [i for batch in resumed for i in batch["id"].tolist()]
out["order"] = dataset().plan.epoch_order(0).tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    source = write_rows(tmp_path_factory.mktemp("fork") / "rows.parquet", ROWS, 16)
    procs = [start(source, f"{i}/2") for i in range(2)]
    yield ",".join(endpoint(p) for p in procs)
    stop(procs)


def _run(script: str, endpoints: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, endpoints], capture_output=True, text=True, timeout=150)


@pytest.mark.timeout(180)
def test_forked_workers_read_every_row_once_and_resume_exactly(nodes):
    proc = _run(EPOCH_AND_RESUME, nodes)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    full = ROWS // 8 * 8
    assert sorted(out["seen"]) == sorted(out["order"][:full]) and len(set(out["seen"])) == full
    assert sorted(out["first"] + out["rest"]) == sorted(out["order"][:full])
    assert not out["parent_connected"]  # only the workers connected


@pytest.mark.timeout(180)
def test_iterating_in_the_parent_then_forking_is_refused_in_one_clear_line(nodes):
    proc = _run(PARENT_FIRST, nodes)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "forked from one that had already connected to cache nodes" in proc.stdout
    assert "multiprocessing_context='forkserver'" in proc.stdout


@pytest.mark.timeout(180)
def test_a_checkpoint_before_every_worker_has_delivered_resumes_exactly(nodes):
    """StatefulDataLoader reads each worker's state as soon as the worker calls iter(): that state must
    already name the worker's first step (it named step 0 for every worker: half the epoch read twice)."""
    proc = _run(EARLY_CHECKPOINT, nodes)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    full = sorted(out["order"][: ROWS // 8 * 8])
    for taken in ("0", "1", "3"):
        got = out[taken]
        assert sorted(got) == full, f"after {taken} batches: {len(got)} rows, {len(set(got))} distinct"
