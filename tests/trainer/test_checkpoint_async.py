"""`train.checkpoint_async`: the background write of a checkpoint is completed by the rule of a synchronous save
(renamed only when whole); a failed write is raised when the run waits for it, and its partial directory is
never what resume picks. In this process, as a one-rank group."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from trainer import checkpoint


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _checkpointer(root: str) -> checkpoint.Checkpointer:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    train = SimpleNamespace(checkpoint_every=1, max_steps=10, keep_latest_k=2, checkpoint_async=True)
    return checkpoint.Checkpointer(root, train, model, optimizer, lambda: {"step": 1}, torch.device("cpu"))


@pytest.mark.timeout(60)
def test_a_failed_background_write_is_raised_when_waited_for_and_never_resumed_from(one_rank_group, tmp_path,
                                                                                     monkeypatch):
    root = str(tmp_path / "checkpoints")
    saver = _checkpointer(root)
    assert saver.save(1) == os.path.join(root, "step-1")
    saver.save(2)  # waits for step 1's write first: renamed whole
    assert "step-1" in os.listdir(root)
    saver.finish()
    assert checkpoint.latest(root) == os.path.join(root, "step-2")

    def broken(self, plan, planner):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    saver = _checkpointer(root)
    saver.save(3)  # the step goes on; the failure comes to light when the run waits for the write
    with pytest.raises(BaseException, match="Input/output error"):
        saver.finish()
    assert sorted(os.listdir(root)) == ["step-1", "step-2"]  # no step-3, no partial directory
    assert checkpoint.latest(root) == os.path.join(root, "step-2")
