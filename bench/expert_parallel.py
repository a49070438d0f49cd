"""Expert parallelism (strategy.ep): step time, peak memory per rank and bytes sent per rank per step of a
16-expert mixture on `--nproc` ranks under fsdp2 with ep 1, 2 and 4 (gloo on CPUs, as the ranks of this machine).

Each ep runs as one torchrun job of this file: every rank builds the model as trainer.worker does (ParallelDims, the
meta model, `parallelize`, `init_weights`), trains `--steps` AdamW steps on random tokens, and counts the bytes it
sends by the collectives' own sizes (their calls wrapped here, in the bench's ranks only): all-to-all the rows
it sends to other ranks; all-gather its input to each other rank; reduce-scatter and all-reduce (n - 1) / n of
their input (and all-reduce twice: reduce, then gather). Peak memory is the rank's maximum RSS.

    python bench/expert_parallel.py [--nproc 4] [--steps 6] [--ep 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

# The mixture: 16 experts of top 2, wide enough that the experts hold most of the parameters.
MODEL = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 512, "vocab_size": 256,
         "max_seq_len": 512, "n_experts": 16, "n_experts_per_token": 2, "moe_ffn_dim": 1024,
         "output_router_logits": True, "router_aux_loss_coef": 0.01}
ROWS, SEQ = 4, 512  # per rank and step


def _counting(dist, sent: dict) -> None:
    """Wrap the collectives that FSDP2 and the experts' dispatch call, adding the bytes each sends to `sent`."""

    def arg(args, kwargs, index: int, name: str):
        return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)

    def wrap(name, count):
        original = getattr(dist, name)

        def call(*args, **kwargs):
            sent[name] = sent.get(name, 0) + count(lambda i, n: arg(args, kwargs, i, n))
            return original(*args, **kwargs)

        setattr(dist, name, call)

    def all_to_all(a) -> int:
        x, splits, group = a(1, "input"), a(3, "input_split_sizes"), a(4, "group")
        if not splits:
            return x.nbytes * (dist.get_world_size(group) - 1) // dist.get_world_size(group)
        return (x.shape[0] - splits[dist.get_rank(group)]) * (x[0].nbytes if x.shape[0] else 0)

    def shared(a, tensor: tuple[int, str], group: int, factor: int) -> int:
        """`factor` x (n - 1) / n of the tensor's bytes, over a group of n."""
        n = dist.get_world_size(a(group, "group"))
        return factor * a(*tensor).nbytes * (n - 1) // n

    wrap("all_to_all_single", all_to_all)
    wrap("all_gather_single", lambda a: shared(a, (1, "input_tensor"), 2, dist.get_world_size(a(2, "group"))))
    wrap("reduce_scatter_single", lambda a: shared(a, (1, "input"), 3, 1))
    wrap("all_reduce", lambda a: shared(a, (0, "tensor"), 2, 2))


def rank_main(ep: int, steps: int, out: str) -> None:
    import torch

    from trainer.config import StrategyConfig
    from trainer.models import Transformer

    model, sent = parallel_model(StrategyConfig(name="fsdp2_ep", dp_shard=-1, ep=ep), lambda: Transformer(
        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, **MODEL))
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    train(model, lambda: torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ + 1), generator=gen), steps, sent, out)


def parallel_model(strategy, make):
    """(the model `make()` builds, parallelized by `strategy` over this job's gloo ranks as trainer.worker does and
    initialised, the dict its collectives count their bytes into)."""
    import torch
    import torch.distributed as dist

    from trainer.models import init_weights, param_shapes
    from trainer.parallel import ParallelDims, parallelize

    dist.init_process_group("gloo")
    sent: dict[str, int] = {}
    _counting(dist, sent)
    dims = ParallelDims.from_config(strategy, dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = make()
    shapes = param_shapes(model)
    model = parallelize(model, dims, strategy)
    init_weights(model, shapes, seed=0, std=0.02, n_layers=model.n_layers)
    return model, sent


def rss_gb() -> float:
    """This process's resident memory now, in GiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def train(model, batch, steps: int, sent: dict, out: str) -> None:
    """`steps` AdamW steps of `model` on `batch()`'s rows (tokens, one more than the targets), then this rank's
    rank-<r>.json in `out`: its median step time after the first, its peak RSS (maximum resident memory, GiB),
    its RSS before the first step, and the bytes `sent` per step after the first (the first step's are the lazy
    initialisation's too; with one step, that step's)."""
    import torch
    import torch.distributed as dist

    from trainer.parallel import clip_grad_norm_

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    times, before, resident = [], {}, rss_gb()
    for step in range(steps):
        tokens = batch()
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        if step == 0 and steps > 1:
            before = dict(sent)
    per_step = {k: (v - before.get(k, 0)) / max(steps - 1, 1) for k, v in sent.items()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    timed = times[1:] or times
    with open(os.path.join(out, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump({"step_s": sorted(timed)[len(timed) // 2], "peak_gb": peak, "before_gb": resident,
                   "sent": per_step}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(script: str, nproc: int, args: list) -> list[dict] | str:
    """Every rank's report of a torchrun job of `nproc` ranks running `script --rank *args out`, or the last
    line of its error."""
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(["torchrun", f"--nproc-per-node={nproc}", "--standalone", script, "--rank",
                               *map(str, args), out], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "Error" in line]
            return errors[-1] if errors else f"exit code {proc.returncode}"
        ranks = []
        for r in range(nproc):
            with open(os.path.join(out, f"rank-{r}.json")) as f:
                ranks.append(json.load(f))
    return ranks


def measure(ep: int, nproc: int, steps: int) -> dict:
    ranks = run_ranks(__file__, nproc, [ep, steps])
    if isinstance(ranks, str):
        return {"ep": ep, "error": ranks}
    sent = {k: max(r["sent"].get(k, 0) for r in ranks) for k in ranks[0]["sent"]}
    return {"ep": ep, "step_s": max(r["step_s"] for r in ranks), "peak_gb": max(r["peak_gb"] for r in ranks),
            "sent": sent}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    print(f"16 experts (top 2) x {MODEL['n_layers']} layers, dim {MODEL['dim']}, expert hidden {MODEL['moe_ffn_dim']}; "
          f"{ROWS} x {SEQ} tokens per rank and step; {args.nproc} ranks, fsdp2 (dp_shard={args.nproc})\n")
    print("| ep | step (s) | peak RSS per rank (GiB) | MB sent per rank per step: all-to-all | all-gather "
          "| reduce-scatter | all-reduce |")
    print("|---|---|---|---|---|---|---|")
    for ep in args.ep:
        row = measure(ep, args.nproc, args.steps)
        if "error" in row:
            print(f"| {ep} | {row['error']} |")
            continue
        mb = [row["sent"].get(k, 0) / 2**20 for k in ("all_to_all_single", "all_gather_single",
                                                      "reduce_scatter_single", "all_reduce")]
        print(f"| {ep} | {row['step_s']:.3f} | {row['peak_gb']:.2f} | " + " | ".join(f"{v:.1f}" for v in mb) + " |",
              flush=True)


if __name__ == "__main__":
    main()
