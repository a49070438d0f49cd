"""A bench script loaded by its path, as module `bench_<name>`.

bench/ is no package, and its scripts' own names are taken elsewhere (`kernels` is Hugging Face's hub
kernels package, which transformers imports when it finds one; `coverage` is coverage.py's;
`datacache` is ours), so a test never puts bench/ on sys.path nor registers a script under its bare name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    """bench/<name>.py, imported once per process as sys.modules['bench_<name>']."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        module = sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]
