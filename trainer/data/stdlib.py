"""`data=stdlib`: the Python standard library's own source files, real text on every machine, tokenized byte by
byte: the default run's corpus. Its fingerprint (the interpreter's version, the files' count and size) keys the
cached build (`trainer.data.corpus`)."""

from __future__ import annotations

import functools
import glob
import os
import sys
import sysconfig
from collections.abc import Iterator

import numpy as np

from trainer.data import tokenizer


@functools.cache  # the driver and an in-process worker each fingerprint the corpus; the walk takes ~0.5 s
def _files() -> tuple[str, ...]:
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return tuple(sorted(f for f in files if "site-packages" not in f.split(os.sep)))


def fingerprint(cfg) -> dict:
    """What the corpus is built from: a new Python, or other files, is another corpus."""
    files = _files()
    return {"python": sys.version.split()[0], "files": len(files), "bytes": sum(os.path.getsize(f) for f in files)}


def documents(cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(document id, token ids ending in EOS) for every source file, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    for path in _files():
        with open(path, "rb") as f:
            yield os.path.relpath(path, root), tokenizer.encode(f.read())
