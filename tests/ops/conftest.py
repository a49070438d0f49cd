"""Where the op tests run: on CUDA tensors with compiled kernels when a GPU is present, else on CPU tensors
under Triton's interpreter (the root conftest sets TRITON_INTERPRET=1 when there is no GPU)."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=DTYPES, ids=["fp32", "bf16", "fp16"])
def dtype(request) -> torch.dtype:
    return request.param
