"""A torchrun worker for tests/trainer/models/test_families.py: for each strategy and each Hugging Face directory given,
every rank loads the model placed as trainer.worker places it, takes the loss of the same batch (every rank the
same rows, so the data split is not what is compared) and its gradients, and rank 0 writes, per strategy and
model, the loss and each parameter's whole gradient next to one process's (`from_hf`) to OUT/results.json.

    torchrun --nproc-per-node 2 -m tests.trainer.family_ranks OUT STRATEGY[,STRATEGY...] HF_DIR...
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainer.config import StrategyConfig
from trainer.models import from_hf, hf, unwrap
from trainer.parallel import ParallelDims, parallelize, uses_loss_parallel

DEGREES = {"ddp": {"dp_replicate": -1, "data_parallel": "ddp"}, "fsdp2": {"dp_shard": -1}, "tp": {"tp": -1},
           "fsdp2_tp": {"dp_shard": -1, "tp": 2}}
TOKENS = torch.randint(0, 320, (2, 25), generator=torch.Generator().manual_seed(0))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def loss_and_grads(model, parallel_loss: bool) -> tuple[float, dict[str, torch.Tensor]]:
    with loss_parallel() if parallel_loss else contextlib.nullcontext():
        loss = model(TOKENS[:, :-1], TOKENS[:, 1:])
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): _whole(p.grad)
             for name, p in unwrap(model).named_parameters()}
    return float(_whole(loss)), grads


def compare(path: str, strategy: str) -> dict:
    cfg = StrategyConfig(name=strategy, **DEGREES[strategy])
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = hf.build(path)
    vocab = model.tok_embeddings.num_embeddings
    model = parallelize(model, dims, cfg)
    hf.load_weights(model, path)
    loss, grads = loss_and_grads(model, uses_loss_parallel(cfg, vocab, dims))
    ref_loss, ref_grads = loss_and_grads(from_hf(path), False)
    worst = max(((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in ref_grads.items())
    return {"loss": loss, "reference_loss": ref_loss, "worst_grad_error": worst, "params": len(grads)}


def main(out: str, strategies: str, *paths: str) -> None:
    dist.init_process_group("gloo")
    results = {s: {os.path.basename(p): compare(p, s) for p in paths} for s in strategies.split(",")}
    if dist.get_rank() == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
