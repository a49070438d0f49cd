"""Peak memory per rank of one training step: the `debug` model (conf/model/debug.yaml, the byte-level
vocabulary) on one row of 8k, 16k and 32k tokens under context parallelism cp 1, 2 and 4, and a 16-expert mixture
under expert parallelism ep 1, 2 and 4 (bench/expert_parallel.py's model and ranks). CPU, gloo, processes of this
machine.

The cp rows, by default, are `python -m trainer` runs, the path a user runs: `model=debug model.max_seq_len=<seq>
data.seq_len=<seq> train.global_batch_size=1 train.max_steps=<steps> train.eval_batches=1` on the default corpus
(data=stdlib), cp > 1 with `strategy=fsdp2_cp strategy.cp=<cp>` on cp torchrun ranks, cp=1 the plain one-process
run (the trainer evaluates one batch and checkpoints at the last step: it always does). Peak RSS per rank is the
run's summary.json `peak_memory_gb_per_rank` (the process's maximum resident memory, `ru_maxrss`), the largest
rank's; the step time is metrics.jsonl's last. The issue's target (cp=4 at 32k tokens at most 0.4x cp=1's peak
memory per rank) is read there. Bytes sent are not counted on that path.

`--model-overrides model.<key>=<value> ...` runs the cp rows (either path) on `model=debug` changed by them, e.g.
twice as wide (`model.dim=512 model.n_heads=8 model.n_kv_heads=4 model.ffn_dim=1376`, the byte-level vocabulary
and the corpus unchanged): the activations cp divides grow with the width, the ~0.6 GiB per rank that no degree
divides (interpreter, torch, gloo, pyarrow, the corpus's rows) does not.

`--harness` runs the cp rows in the bench's own ranks instead (bench/expert_parallel.py's `parallel_model`: the
meta model, `parallelize`, `init_weights`, AdamW steps on random tokens, the same row on every cp rank), which
count the bytes each collective sends per rank per step from its own size: the exchange's all-gathers of each
layer's keys and values (its input to each other cp rank; on the mask-free path once in the forward and again in
the backward) and the reduce-scatters of their gradients ((n - 1) / n of the whole row's), FSDP2's all-gathers,
reduce-scatters and all-reduces. It also gives the step peak: the peak RSS less the resident memory just before
the first step. With `--steps` 1 (the default: a 32k step takes minutes on two cores) the bytes are the one
step's, FSDP2's lazy initialisation included; with more, the mean of the steps after the first.

Both count what the C allocators keep resident. `--allocator` is the ranks' `train.allocator` (trainjob.allocator;
the harness's ranks set it as the worker does): at its default, auto, every row here (8k tokens and more) runs
under `release`, glibc's mmap threshold fixed at 1 MiB so that a freed activation goes back to the kernel at once;
`--allocator adaptive` leaves glibc's own threshold, which rises to the largest block freed (up to 32 MiB) and
then keeps the holes a step's freed activations leave in its heap resident (docs/parallelism.md gives both).

    python bench/parallel_memory.py [--seq 8192 16384 32768] [--cp 1 2 4] [--steps 1] [--harness]
        [--model-overrides model.KEY=VALUE ...] [--allocator auto|adaptive|release] [--ep 1 2 4]
"""


from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

from bench import expert_parallel  # noqa: E402  (the path above first)
from trainjob.allocator import POLICIES  # noqa: E402

EXCHANGE = ("kv_all_gather", "kv_reduce_scatter")
FSDP = ("all_gather_single", "reduce_scatter_single", "all_reduce")


def _counting_exchange(sent: dict) -> None:
    """Count the bytes of the cp exchange into `sent`: the all-gathers of keys and values (`ContextParallel.whole`,
    the mask-free attention's, in its forward and again in its backward; `ContextParallel.gather`, the masked
    attention's autograd one) and the reduce-scatters of their gradients (`ContextParallel.scatter`; the autograd
    gather's backward, counted when the gradient arrives)."""
    import torch.distributed as dist

    from trainer.parallel.context import ContextParallel

    def add(key: str, nbytes: float) -> None:
        sent[key] = sent.get(key, 0) + nbytes

    def counted(method, key: str, share):
        def call(self, x, dim=1):
            add(key, share(x, dist.get_world_size(self.group)))
            if method is ContextParallel.gather and x.requires_grad:
                x.register_hook(lambda grad: add("kv_reduce_scatter", grad.nbytes * (self.size - 1)))
            return method(self, x, dim)
        return call

    ContextParallel.gather = counted(ContextParallel.gather, "kv_all_gather", lambda x, n: x.nbytes * (n - 1))
    ContextParallel.whole = counted(ContextParallel.whole, "kv_all_gather", lambda x, n: x.nbytes * (n - 1))
    ContextParallel.scatter = counted(ContextParallel.scatter, "kv_reduce_scatter",
                                      lambda x, n: x.nbytes * (n - 1) / n)


def debug_model(seq: int, overrides: list[str]):
    """`model=debug` as the trainer composes it, with `overrides` (`model.<key>=<value>`), rotary tables for `seq`
    tokens."""
    from omegaconf import OmegaConf

    from trainer.config.model import ModelConfig
    from trainer.models import build

    preset = OmegaConf.load(os.path.join(REPO, "conf/model/debug.yaml"))
    changed = OmegaConf.from_dotlist([o.removeprefix("model.") for o in overrides])
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), preset, changed, {"max_seq_len": seq})
    return build(OmegaConf.to_object(cfg))


def rank_main(cp: int, seq: int, steps: int, overrides: list[str], policy: str, out: str) -> None:
    import torch

    from trainer.config import StrategyConfig
    from trainer.config.model import BYTE_VOCAB_SIZE
    from trainjob import allocator

    if allocator.policy_for(policy, seq, "cpu") == "release":  # as trainer.worker does
        allocator.release_freed_buffers()

    strategy = StrategyConfig(name="fsdp2_cp" if cp > 1 else "fsdp2", dp_shard=-1, cp=cp)
    model, sent = expert_parallel.parallel_model(strategy, lambda: debug_model(seq, overrides))
    _counting_exchange(sent)
    gen = torch.Generator().manual_seed(0)  # every cp rank reads the same row
    expert_parallel.train(model, lambda: torch.randint(0, BYTE_VOCAB_SIZE, (1, seq + 1), generator=gen), steps,
                          sent, out)


def trainer_args(cp: int, seq: int, steps: int, overrides: list[str], policy: str, run_dir: str) -> list[str]:
    """`python -m trainer`'s command for one point: `model=debug` (and `overrides`) on one row of `seq` tokens
    (data=stdlib, the default corpus), `steps` steps, one eval batch (the least the trainer takes: it evaluates at
    the last step); cp > 1: `strategy=fsdp2_cp` on cp torchrun ranks; cp=1: the plain single-process run."""
    args = [sys.executable, "-m", "trainer", "model=debug", *overrides, f"model.max_seq_len={seq}",
            f"data.seq_len={seq}", "train.global_batch_size=1", f"train.max_steps={steps}", "train.eval_batches=1",
            "train.log_every=1", "train.progress=false", f"train.allocator={policy}", f"hydra.run.dir={run_dir}"]
    if cp > 1:
        args += ["strategy=fsdp2_cp", f"strategy.cp={cp}", "+runtime=torch-distributed",
                 f"runtime.nproc_per_node={cp}"]
    return args


def trainer_point(cp: int, seq: int, steps: int, overrides: list[str], policy: str) -> dict | str:
    """One `python -m trainer` run's peak RSS per rank (summary.json's `peak_memory_gb_per_rank`, the largest
    rank's) and its last step's time (metrics.jsonl), or the last line of its error."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        proc = subprocess.run(trainer_args(cp, seq, steps, overrides, policy, run_dir), cwd=tmp, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": REPO})
        if proc.returncode != 0:
            errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "rror" in line]
            return errors[-1] if errors else f"exit code {proc.returncode}"
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            last = [json.loads(line) for line in f if line.strip()][-1]
    return {"peak_gb": max(summary["peak_memory_gb_per_rank"]), "step_s": last["step_time_s"]}


def trainer_table(seqs: list[int], cps: list[int], steps: int, overrides: list[str], policy: str) -> None:
    print(f"`python -m trainer {' '.join(['model=debug', *overrides])} data.seq_len=<seq> "
          f"train.global_batch_size=1 train.max_steps={steps} train.allocator={policy}` "
          "(cp > 1: `strategy=fsdp2_cp strategy.cp=<cp>` on cp torchrun ranks of this CPU, gloo; cp=1: one "
          "process); peak RSS per rank: summary.json's `peak_memory_gb_per_rank`, the largest rank's. Bytes sent "
          "are not counted on this path (its collectives are not instrumented): `--harness` counts them\n")
    print("| seq | cp | step (s) | peak RSS per rank (GiB) | x cp=1 |")
    print("|---|---|---|---|---|")
    for seq in seqs:
        first = None
        for cp in cps:
            row = trainer_point(cp, seq, steps, overrides, policy)
            if isinstance(row, str):
                print(f"| {seq} | {cp} | {row} |", flush=True)
                continue
            first = first or row["peak_gb"]
            print(f"| {seq} | {cp} | {row['step_s']:.1f} | {row['peak_gb']:.2f} | {row['peak_gb'] / first:.2f} |",
                  flush=True)


def cp_table(seqs: list[int], cps: list[int], steps: int, overrides: list[str], policy: str) -> None:
    print(f"`{' '.join(['model=debug', *overrides])}`, one row of seq tokens a step, {steps} step(s); cp ranks of "
          "this CPU (gloo), fsdp2 over them. The bench's own setup, not `python -m trainer`: its ranks build and "
          "step the model through trainer.parallel as trainer.worker does, on random tokens\n")
    print("| seq | cp | step (s) | peak RSS per rank (GiB) | x cp=1 | step peak per rank (GiB) | x cp=1 "
          "| MB sent per rank per step: K/V all-gather | K/V reduce-scatter | FSDP2 all-gather | reduce-scatter "
          "| all-reduce |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seq in seqs:
        first = None
        for cp in cps:
            ranks = expert_parallel.run_ranks(__file__, cp, [cp, seq, steps, " ".join(overrides), policy])
            if isinstance(ranks, str):
                print(f"| {seq} | {cp} | {ranks} |", flush=True)
                continue
            peak = max(r["peak_gb"] for r in ranks)
            step = max(r["peak_gb"] - r["before_gb"] for r in ranks)
            first = first or (peak, step)
            mb = [max(r["sent"].get(k, 0) for r in ranks) / 2**20 for k in (*EXCHANGE, *FSDP)]
            print(f"| {seq} | {cp} | {max(r['step_s'] for r in ranks):.1f} | {peak:.2f} | {peak / first[0]:.2f} "
                  f"| {step:.2f} | {step / first[1]:.2f} | " + " | ".join(f"{v:.1f}" for v in mb) + " |", flush=True)


def ep_table(eps: list[int], nproc: int, steps: int) -> None:
    print(f"\n16 experts (top 2), bench/expert_parallel.py's mixture and rows; {nproc} ranks, fsdp2\n")
    print("| ep | step (s) | peak RSS per rank (GiB) | MB sent per rank per step: all-to-all | all-gather "
          "| reduce-scatter | all-reduce |")
    print("|---|---|---|---|---|---|---|")
    for ep in eps:
        row = expert_parallel.measure(ep, nproc, steps)
        if "error" in row:
            print(f"| {ep} | {row['error']} |")
            continue
        mb = [row["sent"].get(k, 0) / 2**20 for k in ("all_to_all_single", *FSDP)]
        print(f"| {ep} | {row['step_s']:.2f} | {row['peak_gb']:.2f} | " + " | ".join(f"{v:.1f}" for v in mb)
              + " |", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split(), sys.argv[6],
                  sys.argv[7])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--ep", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--ep-steps", type=int, default=3)
    parser.add_argument("--harness", action="store_true",
                        help="the cp rows from the bench's own ranks (bytes sent and step peak counted) rather "
                             "than python -m trainer runs")
    parser.add_argument("--model-overrides", nargs="*", default=[], metavar="model.KEY=VALUE",
                        help="the cp rows' model: model=debug with these (e.g. a wider one: model.dim=512 "
                             "model.n_heads=8 model.n_kv_heads=4 model.ffn_dim=1376)")
    parser.add_argument("--allocator", choices=POLICIES, default="auto",
                        help="the ranks' train.allocator (auto: release from 8192-token rows, so every row here)")
    args = parser.parse_args()
    for override in args.model_overrides:
        if not override.startswith("model.") or "=" not in override:
            parser.error(f"--model-overrides {override!r}: each must be model.<key>=<value>")
    if args.cp:
        (cp_table if args.harness else trainer_table)(args.seq, args.cp, args.steps, args.model_overrides,
                                                      args.allocator)
    if args.ep:
        ep_table(args.ep, max(args.ep), args.ep_steps)


if __name__ == "__main__":
    main()
