"""A torchrun worker for tests/trainer/generate/test_generation.py: every rank loads a Hugging Face directory under a
strategy (`ddp`, `fsdp2` or `tp`, as trainer.worker places a model), generates greedily for the prompts
`prompts(rank)` of its data-parallel group, and writes them and its completions to OUT/rank-<r>.json.

    torchrun --nproc-per-node 2 -m tests.trainer.generate_ranks HF_DIR STRATEGY OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from trainer.config import StrategyConfig
from trainer.generate import generate
from trainer.models import hf
from trainer.parallel import ParallelDims, parallelize

DEGREES = {"ddp": {"dp_replicate": -1, "data_parallel": "ddp"}, "fsdp2": {"dp_shard": -1}, "tp": {"tp": -1}}


def prompts(group: int) -> list[list[int]]:
    """Prompts of different lengths, different for each data-parallel group."""
    gen = torch.Generator().manual_seed(100 + group)
    return [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (4 + 3 * group, 11, 2)]


def end_tokens(model, group: int) -> list[int]:
    """The end tokens of `group`: in odd groups each row's third greedy token, so that their ranks end within
    three steps while the others run all sixteen. Every rank generates here: a sharded model's are collective."""
    third = [row[-1] for row in generate(model, prompts(group), 3)]
    return third if group % 2 else []


def main(path: str, strategy: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims.from_config(StrategyConfig(name=strategy, **DEGREES[strategy]), dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = hf.build(path)
    model = parallelize(model, dims, StrategyConfig(name=strategy, **DEGREES[strategy]))
    hf.load_weights(model, path)
    model.eval()
    group = rank // dims.tp  # ranks of one tensor-parallel group share their prompts
    mine = prompts(group)
    completions = generate(model, mine, 16, eos=end_tokens(model, group))
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"prompts": mine, "completions": completions}, f)
    dist.barrier()  # every rank's collectives are done before any destroys the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Leave without the interpreter's teardown, where gloo's threads, destroyed late, have been seen to abort a
    # rank that had succeeded ("terminate called without an active exception"), as trainer.worker does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
