"""Precision names (`train.mixed_precision`, `strategy.param_dtype`, `strategy.reduce_dtype`): `auto` is bf16
on CUDA and fp32 elsewhere."""

from __future__ import annotations

AUTO = "auto"
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DTYPES = tuple(TORCH_DTYPES)


def torch_dtype(name: str, device_type: str):
    """The torch dtype for a precision name of this config, `auto` resolved for `device_type`."""
    import torch

    if name == AUTO:
        name = "bf16" if device_type == "cuda" else "fp32"
    return getattr(torch, TORCH_DTYPES[name])
