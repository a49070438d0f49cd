"""How checkpoints are written and read. `train.checkpoint_async`: the background write of a checkpoint is
completed by the rule of a synchronous save (renamed only when whole); a failed write is raised when the run
waits for it, and its partial directory is never what resume picks. The optimizer is kept per parameter name
(so pipeline stages' keys merge), and checkpoints that kept it per param group still load. In this process, as a
one-rank group. `train.checkpoint_threads`: a rank's part in that many files, all in the manifest, loaded whole."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainer.checkpoint import checks, dcp_store, lines, store


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _checkpointer(root: str) -> store.Checkpointer:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    train = SimpleNamespace(checkpoint_every=1, max_steps=10, keep_latest_k=2)
    return store.Checkpointer(root, train, dcp_store.DCPStore(model, optimizer, torch.device("cpu"), asynchronous=True),
                              lambda: {"step": 1})


@pytest.mark.timeout(60)
def test_a_failed_background_write_is_raised_when_waited_for_and_never_resumed_from(one_rank_group, tmp_path,
                                                                                     monkeypatch):
    root = str(tmp_path / "checkpoints")
    saver = _checkpointer(root)
    assert saver.save(1) == os.path.join(root, "step-1")
    saver.save(2)  # waits for step 1's write first: renamed whole
    assert "step-1" in os.listdir(root)
    saver.finish()
    assert lines.latest(root) == os.path.join(root, "step-2")

    def broken(self, plan, planner):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    saver = _checkpointer(root)
    saver.save(3)  # the step goes on; the failure comes to light when the run waits for the write
    with pytest.raises(BaseException, match="Input/output error"):
        saver.finish()
    assert sorted(os.listdir(root)) == ["step-1", "step-2"]  # no step-3, no partial directory
    assert lines.latest(root) == os.path.join(root, "step-2")


@pytest.mark.timeout(60)
def test_the_optimizer_is_saved_per_parameter_and_older_per_group_checkpoints_still_load(one_rank_group, tmp_path):
    root = str(tmp_path / "checkpoints")
    saver = _checkpointer(root)
    saver.store.background = None  # synchronous
    path = saver.save(1)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert "optim.state.weight.exp_avg" in keys and "optim.param_groups.weight.lr" in keys

    older = str(tmp_path / "older")  # as checkpoints were saved before: param groups by index
    model_sd, optim_sd = get_state_dict(saver.store.model, saver.store.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "train": {"step": 7}}, checkpoint_id=older)
    assert "optim.param_groups.0.lr" in dcp.FileSystemReader(older).read_metadata().state_dict_metadata
    fresh = _checkpointer(str(tmp_path / "other")).store
    state = fresh.load(older, {"step": 0})
    assert state["step"] == 7 and torch.equal(fresh.model.weight, saver.store.model.weight)
    exp_avg = saver.store.optimizer.state[saver.store.model.weight]["exp_avg"]
    assert torch.equal(fresh.optimizer.state[fresh.model.weight]["exp_avg"], exp_avg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_checkpoint_threads_split_a_ranks_part_into_that_many_files_that_load_whole(one_rank_group, tmp_path,
                                                                                     asynchronous):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    train = SimpleNamespace(checkpoint_every=1, max_steps=10, keep_latest_k=2)
    dcp = dcp_store.DCPStore(model, optimizer, torch.device("cpu"), asynchronous, threads=3)
    saver = store.Checkpointer(str(tmp_path / "checkpoints"), train, dcp, lambda: {"step": 1})
    path = saver.save(1)
    saver.finish()
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == ["__0_0.distcp", "__0_1.distcp",
                                                                          "__0_2.distcp"]
    assert checks.damage(path) is None  # the manifest holds all three

    torch.manual_seed(1)
    other = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    other_optimizer = torch.optim.AdamW(other.parameters())
    other(torch.ones(2, 8)).sum().backward()
    other_optimizer.step()  # its state made, as a resuming run's is
    fresh = dcp_store.DCPStore(other, other_optimizer, torch.device("cpu"), False)
    assert fresh.load(path, {"step": 0})["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))
    exp_avg = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    loaded = [fresh.optimizer.state[p]["exp_avg"] for p in other.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(loaded, exp_avg, strict=True))
