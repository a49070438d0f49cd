"""Every bench script, run as `python bench/<name>.py`, takes bench/ off sys.path before it imports: its
scripts' names are installed packages' (`kernels` is Hugging Face's hub kernels, which transformers >= 5.25
imports when it finds one; `datacache` is ours), and transformers failed to import under bench/kernels.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (REPO / "bench").glob("*.py"))
# The script's own run (sys.path[0] is its directory, as `python bench/x.py` sets it) to its first exit
# (--help), then where the names that bench/ shadows resolve from.
DRIVER = """
import atexit, importlib.util, json, runpy, sys
script = sys.argv[1]
sys.path[0] = {bench!r}
def where():
    print(json.dumps({{n: getattr(importlib.util.find_spec(n), "origin", None) for n in ("kernels", "datacache")}}))
atexit.register(where)
sys.argv = [script, "--help"]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_bench_script_leaves_its_names_to_the_installed_packages(script):
    run = subprocess.run([sys.executable, "-c", DRIVER.format(bench=str(REPO / "bench")), f"bench/{script}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    where = json.loads(run.stdout.strip().splitlines()[-1])
    assert where["datacache"] == str(REPO / "datacache" / "__init__.py"), run.stderr
    assert not str(where["kernels"] or "").startswith(str(REPO / "bench")), where
