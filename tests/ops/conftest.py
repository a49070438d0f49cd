"""Ops tests run Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 must be set before triton loads)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
