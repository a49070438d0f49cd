"""Kernel coverage of one training step: which ATen ops a step calls, and which of them run in ours.

One step (forward, backward, AdamW) of a model built from the config (`model=debug` by default, or
`model=hf model.path=<dir>` for a Hugging Face model's shapes) runs with `kernels=triton` and under
`ops.enable()`, inside a dispatch trace (`TorchDispatchMode`). For every ATen op the step calls it prints
how many calls, how many bytes they read and wrote, and where it ran: `ours` (routed to `ops/`), `torch`,
or excluded by name with the reason (views and metadata move no data; allocations and the copies a step
needs anyway, such as dtype casts, are not computations). Then the Triton kernels of ours that the step
launched, which includes the model's fused modules (RMSNorm, RoPE, attention, SwiGLU, the loss) whose
work never reaches ATen. On a machine without a GPU it runs under Triton's interpreter (slowly: keep the
shapes small), so CI can check that the coverage does not fall (tests/ops/test_coverage.py).

    python bench/coverage.py [--seq 64] [--batch 2] [override ...]      e.g. model=debug model.n_layers=2
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():  # before triton is imported: it reads this once
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ATen ops that compute nothing a kernel of ours would replace, by the reason the table gives.
WHY = {
    "view": "a new view of the same memory: moves no data",
    "allocation": "new memory, empty or filled with a constant: the allocator's and a memset's work",
    "copy": "a copy or dtype cast the step needs anyway (autocast's casts, .item(), detach)",
    "metadata": "sizes, strides and profiler marks: no tensor data",
}
EXCLUDED = {
    "allocation": {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "scalar_tensor",
                   "zeros", "zeros_like", "ones_like", "new_zeros", "new_ones", "full", "full_like"},
    "copy": {"copy_", "_to_copy", "clone", "detach", "_local_scalar_dense", "lift_fresh_copy"},
    "metadata": {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "set_",
                 "_has_compatible_shallow_copy_type", "_record_function_enter_new", "_record_function_exit"},
}


@dataclasses.dataclass
class Row:
    op: str
    calls: int = 0
    bytes: int = 0
    where: str = "torch"


def _nbytes(values) -> int:
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, (list, tuple)):
            total += _nbytes(v)
    return total


def _name(func) -> str:
    """The op as `ops.enable` names it: `mm`, `add.Tensor` (the overload when it is not the default)."""
    name = func._schema.name.split("::")[-1]
    return name if func._overloadname == "default" else f"{name}.{func._overloadname}"


def _where(func, routed: set[str]) -> str:
    if _name(func) in routed:
        return "ours"
    name = func._schema.name.split("::")[-1]
    if func.is_view or name in {"view", "_unsafe_view", "alias", "as_strided", "t", "expand", "unsqueeze"}:
        return "excluded: view"
    for reason, names in EXCLUDED.items():
        if name in names:
            return f"excluded: {reason}"
    return "torch"


class Trace(TorchDispatchMode):
    """Counts each ATen op (by its overload packet name) with the bytes of its tensor arguments and results
    (none for views), and where it ran. Paused while a Triton kernel launches: what the interpreter does
    with the tensors is not the step's."""

    def __init__(self, routed: set[str]):
        super().__init__()
        self.routed = routed
        self.rows: dict[str, Row] = {}
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            name = _name(func)
            row = self.rows.setdefault(name, Row(name, where=_where(func, self.routed)))
            row.calls += 1
            if row.where != "excluded: view":
                row.bytes += _nbytes(args) + _nbytes((kwargs or {}).values()) + _nbytes([out])
        return out


@contextlib.contextmanager
def _counting_launches(trace: Trace, launches: collections.Counter):
    """Count our Triton kernels' launches by name, and pause the trace while each runs."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def wrap(run):
        def counted(fn, *args, **kwargs):
            launches[getattr(fn.fn, "__qualname__", str(fn))] += 1
            trace.paused += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                trace.paused -= 1

        return counted

    for cls, run in saved.items():
        cls.run = wrap(run)
    try:
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run


def _config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from trainer import config

    config.register()  # the schemas the defaults list names
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        return compose("config", overrides=["kernels=triton", *overrides])


def trace_step(overrides: list[str], seq: int = 64, batch: int = 2):
    """One training step under `ops.enable()` and the trace: (rows by op, our kernels' launch counts)."""
    import ops
    from trainer import models
    from trainer.models import kernels

    cfg = _config(overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        model = models.build(cfg.model)
    model = kernels.apply(model, cfg.kernels)
    model.to_empty(device=device)
    model.init_buffers()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    vocab = model.output_weight.shape[0]
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
    opt = ops.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    launches: collections.Counter = collections.Counter()
    with ops.use_kernels():
        trace = Trace(set(ops.registered()))
        with trace, _counting_launches(trace, launches):
            with autocast:
                loss = model(tokens[:, :-1], targets=tokens[:, 1:])
            loss.backward()
            opt.step()
    return trace.rows, launches


def summary(rows: dict[str, Row]) -> dict:
    """Calls and bytes of the ops that compute (not excluded), and the share of them that ran in ours."""
    computing = [r for r in rows.values() if not r.where.startswith("excluded")]
    ours = [r for r in computing if r.where == "ours"]
    calls, moved = sum(r.calls for r in computing), sum(r.bytes for r in computing)
    return {"ops": len(computing), "ours_ops": len(ours), "calls": calls, "ours_calls": sum(r.calls for r in ours),
            "bytes": moved, "ours_bytes": sum(r.bytes for r in ours)}


def table(rows: dict[str, Row], launches: collections.Counter) -> str:
    lines = [f"{'aten op':<40}{'calls':>7}{'MB':>10}  where"]
    order = sorted(rows.values(), key=lambda r: (r.where.startswith("excluded"), r.where != "torch", -r.bytes))
    lines += [f"{r.op:<40}{r.calls:>7}{r.bytes / 2**20:>10.2f}  {r.where}" for r in order]
    s = summary(rows)
    lines.append(f"computing ops in ours: {s['ours_ops']} of {s['ops']}; calls {s['ours_calls']} of {s['calls']} "
                 f"({s['ours_calls'] / max(1, s['calls']):.0%}); bytes {s['ours_bytes'] / max(1, s['bytes']):.0%}")
    lines.append("excluded ops stay in torch eager, by design: " + "; ".join(f"{k}: {v}" for k, v in WHY.items()))
    lines.append("")
    lines.append(f"{'our Triton kernel':<40}{'launches':>9}")
    lines += [f"{name:<40}{count:>9}" for name, count in sorted(launches.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=64, help="tokens per row")
    parser.add_argument("--batch", type=int, default=2, help="rows")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model=debug model.n_layers=2")
    args = parser.parse_args()
    if args.seq < 1 or args.batch < 1:
        parser.error(f"--seq {args.seq} --batch {args.batch}: both must be at least 1")
    rows, launches = trace_step(args.overrides or ["model=debug"], args.seq, args.batch)
    print(table(rows, launches))


if __name__ == "__main__":
    main()
