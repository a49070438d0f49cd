"""The `lr_schedule` group: each decay is the schedule transformers ships under that name (the peer's own
functions, from PyPI), our warmup is TorchTitan's, and a key that moved out of `optim` is refused naming its
new place."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import optimization

from tests.conftest import REPO
from trainer.training.optimizer import lr_factor

TOTAL = 40


def _peer(schedule, *args, **kwargs) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lrs = schedule(optimizer, *args, **kwargs)
    factors = []
    for _ in range(TOTAL + 1):
        factors.append(lrs.get_last_lr()[0])
        optimizer.step()
        lrs.step()
    return factors


@pytest.mark.parametrize(("decay", "min_factor", "peer"), [
    ("linear", 0.0, lambda: _peer(optimization.get_linear_schedule_with_warmup, 0, TOTAL)),
    ("cosine", 0.0, lambda: _peer(optimization.get_cosine_schedule_with_warmup, 0, TOTAL)),
    ("cosine", 0.1, lambda: _peer(optimization.get_cosine_with_min_lr_schedule_with_warmup, 0, TOTAL,
                                  min_lr_rate=0.1)),
    ("constant", 0.1, lambda: _peer(optimization.get_constant_schedule)),
])
def test_each_decay_is_the_schedule_transformers_ships_by_that_name(decay, min_factor, peer):
    ours = [lr_factor(step, 0, TOTAL, min_factor, decay) for step in range(TOTAL + 1)]
    assert ours == pytest.approx(peer(), abs=1e-12)


def test_the_warmup_is_torchtitans_and_sqrt_ends_at_the_floor():
    # TorchTitan's linear_warmup_stable_decay: (step + 1) / (warmup + 1) over the warmup steps.
    assert [lr_factor(s, 4, 20, 0.1, "sqrt") for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lr_factor(4, 4, 20, 0.1, "sqrt") == 1.0 and lr_factor(20, 4, 20, 0.1, "sqrt") == pytest.approx(0.1)
    assert lr_factor(12, 4, 20, 0.0, "sqrt") == pytest.approx(1 - 0.5 ** 0.5)


def test_a_key_moved_out_of_optim_is_refused_naming_its_new_place(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer", "optim.warmup_steps=3", f"hydra.run.dir={tmp_path}/run"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert proc.stderr.strip().splitlines() == [
        "error: invalid config: optim.warmup_steps='3': moved to lr_schedule.warmup_steps (the lr_schedule group): "
        "give that key"]
