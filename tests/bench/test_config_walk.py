"""bench/config_walk.py on the default run: the config's walk from `python -m trainer` to the first optimizer
step goes back into a module it had already left at most a handful of times (issue 39: 44 at first, 15 before
the job's shape was read once), and every call it counts is one a real run made (it ends in the optimizer)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
@pytest.mark.e2e
def test_the_default_runs_config_walk_goes_back_at_most_a_handful_of_times(tmp_path):
    run = subprocess.run([sys.executable, "bench/config_walk.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=500, env={**os.environ, "TRAINJOB_CACHE": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("| (the default run)"))
    calls, modules, stays, back = (int(n) for n in re.findall(r"\| (\d+) ", row + " "))
    assert back <= 5, run.stdout
    assert calls >= modules >= 20 and stays >= modules, row
    walk = next(line for line in run.stdout.splitlines() if line.startswith("walk: "))
    assert walk.startswith("walk: trainer.prepare.callbacks -> trainer.__main__ -> trainer.prepare.preflight")
    assert walk.endswith("trainer.training.loop -> trainer.training.optimizer"), walk
    assert "(the run ended before an optimizer step)" not in run.stdout
