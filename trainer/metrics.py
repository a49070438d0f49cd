"""Training metrics: FLOPs per token and MFU (TorchTitan's formula), memory, and the metrics.jsonl writer."""

from __future__ import annotations

import json
import resource
import sys

import torch

# Dense peak FLOP/s per device for bf16 (fp32 inputs run on TF32 tensor cores at half of it).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
}


def flops_per_token(num_params_no_embedding: int, n_layers: int, n_heads: int, head_dim: int,
                    seq_len: int) -> float:
    """6·N for the dense layers plus 12·L·H·D·T for attention's score and value products (training)."""
    return 6 * num_params_no_embedding + 12 * n_layers * n_heads * head_dim * seq_len


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value if bf16 else value / 2
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated GPU memory on CUDA, else the process's maximum RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


class JsonlWriter:
    """Appends one JSON object per line; a resumed run keeps appending to the same file."""

    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()
