"""Kernel coverage of the training step `python -m trainer` runs: which ATen ops it calls, and which of them
reach our kernels.

Each run is built as the CLI builds it: the config composed from conf/ with the overrides, checked and its
run directory claimed (`trainer.__main__.prepare_run`), then trained in this process by the worker, as the
default run is. While it trains, every call of `Trainer._train_step` (forward, backward, clipping, the
optimizer: what `kernels=triton` runs under `ops.use_kernels()`) is traced at the ATen level
(`TorchDispatchMode`). A call is `ours` when it reached our kernel (`ops.aten.calls` counted it), else
it ran in PyTorch, and the table says why: `kernels=torch`, left out by `kernels.include`/`exclude`, not in
our ATen table, or excluded from the count by its kind (views and metadata move no data; allocations and
the copies a step needs anyway, such as dtype casts and `.item()`, are not computations). Then the Triton
kernels of ours the step launched: the model's fused modules (RMSNorm, RoPE, attention, SwiGLU, the loss)
and the optimizer never reach ATen, their launches do.

It measures `model=debug` and each family of trainer/config/families.py (a tiny random directory written here with
transformers, nothing downloaded) natively and with `model.impl=transformers`, under the pretraining, SFT,
DPO, GRPO and KD recipes, GRPO's rollout (the generation path) as a row of its own, and ends with one
table: each row's share of computing ATen calls in ours and the ops it left to PyTorch (a row
`python -m trainer` refuses says why instead). On a machine without a GPU the kernels run under Triton's
interpreter (slow: keep the shapes small), so CI can hold the floor (tests/ops/test_coverage.py).

    python bench/coverage.py [--families debug,llama,...] [--impl native,transformers] [--recipes pretrain,...]
                             [--kernels torch,triton] [--seq 16] [--batch 2] [--steps 1] [--quiet]
                             [override ...]      e.g. kernels.exclude=[mm,addmm,bmm]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
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
    "metadata": "sizes, strides, dtypes and profiler marks: no tensor data",
    "collective": "communication between ranks (NCCL's or gloo's), no kernel of ours would replace",
}
EXCLUDED = {
    "allocation": {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "scalar_tensor",
                   "zeros", "zeros_like", "ones_like", "new_zeros", "new_ones", "full", "full_like", "fill_",
                   "zero_", "new_full"},
    "copy": {"copy_", "_to_copy", "clone", "detach", "_local_scalar_dense", "lift_fresh", "lift_fresh_copy"},
    "metadata": {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "set_",
                 "_has_compatible_shallow_copy_type", "_record_function_enter_new", "_record_function_exit",
                 "promote_types"},
    "collective": {"allreduce_", "allgather_", "_allgather_base_", "broadcast_", "reduce_scatter_",
                   "_reduce_scatter_base_", "allgather_into_tensor_coalesced_", "barrier"},
}
VIEWS = {"view", "_unsafe_view", "alias", "as_strided", "t", "expand", "unsqueeze"}
KERNELS = ("torch", "triton")
RECIPES = ("pretrain", "sft", "dpo", "grpo", "kd")
IMPLS = ("native", "transformers")


def families() -> tuple[str, ...]:
    """debug (model=debug) and each family of trainer/config/families.py, as a tiny random Hugging Face directory
    (tests/trainer/hf_models.py)."""
    from trainer.config.families import BY_NAME

    return ("debug", *BY_NAME)


# What `python -m trainer` needs beside kernels=triton for a row to run, by (family, model.impl): transformers'
# Gemma 2 and Granite transform their logits after the output layer, which the fused loss would skip (the run
# says so in one line).
NEEDS = {("gemma2", "transformers"): ["kernels.exclude=[fused_linear_cross_entropy]"],
         ("granite", "transformers"): ["kernels.exclude=[fused_linear_cross_entropy]"]}
FLOOR = 0.95  # the share of computing ATen calls in ours each row must reach (issue 49)


@dataclasses.dataclass
class Row:
    op: str
    calls: int = 0
    ours: int = 0
    bytes: int = 0
    kind: str = ""  # the excluded kind (view, allocation, copy, metadata), or "" for a computing op


@dataclasses.dataclass
class Coverage:
    """One traced run: its ATen ops, our kernels' launches, and why the others ran in PyTorch."""

    label: str
    rows: dict[str, Row]
    launches: collections.Counter
    reasons: dict[str, str]  # computing op -> why it ran in PyTorch
    summary: dict
    rollout: dict[str, Row] = dataclasses.field(default_factory=dict)  # GRPO's generation and scoring


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


def _kind(func) -> str:
    name = func._schema.name.split("::")[-1]
    if func.is_view or name in VIEWS:
        return "view"
    return next((reason for reason, names in EXCLUDED.items() if name in names), "")


class Trace(TorchDispatchMode):
    """Counts each ATen call by op, with the bytes of its tensor arguments and results (none for views), and
    whether it reached our kernel (`ops.aten.calls` grew). Paused while a Triton kernel launches: what the
    interpreter does with the tensors is not the step's."""

    def __init__(self):
        super().__init__()
        from ops.aten import calls

        self.calls = calls
        self.rows: dict[str, Row] = {}
        self.rollout: dict[str, Row] = {}  # the calls made while GRPO generates and scores (its rollout)
        self.generating = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        if torch.is_inference_mode_enabled() and func._can_decompose():
            # Under inference mode (`trainer.generate`) an op that autograd's key would decompose reaches this mode
            # whole; decomposed here, its parts are counted as they are outside it (they are what runs).
            with self:
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        name = _name(func)
        before = self.calls[name]
        out = func(*args, **(kwargs or {}))
        for rows in (self.rows, self.rollout) if self.generating else (self.rows,):
            row = rows.setdefault(name, Row(name, kind=_kind(func)))
            row.calls += 1
            row.ours += self.calls[name] > before
            if row.kind != "view":
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


@contextlib.contextmanager
def tracing_steps(trace: Trace, launches: collections.Counter):
    """Trace every training step the loop runs inside the block (`Trainer._train_step`, as the CLI calls it)."""
    from trainer.recipes.grpo import GRPO
    from trainer.training import loop

    step, rollout = loop.Trainer._train_step, GRPO._generate_and_score

    def traced(self, batch):
        with trace, _counting_launches(trace, launches):
            return step(self, batch)

    def generating(self, *args, **kwargs):
        trace.generating += 1
        try:
            return rollout(self, *args, **kwargs)
        finally:
            trace.generating -= 1

    loop.Trainer._train_step, GRPO._generate_and_score = traced, generating
    try:
        yield
    finally:
        loop.Trainer._train_step, GRPO._generate_and_score = step, rollout


def compose(overrides: list[str]):
    """The config `python -m trainer <overrides>` composes."""
    from trainer.config.compose import compose as compose_config

    return compose_config(overrides)


def run_cli(overrides: list[str], run_dir: str) -> dict:
    """Train the run `python -m trainer <overrides> hydra.run.dir=<run_dir>` trains, as it does: checked, the
    directory claimed and its config saved, the worker called in this process. Its summary."""
    from trainer.__main__ import prepare_run
    from trainer.prepare.run_dir import let_go

    cfg = compose(overrides)
    cfg.run_dir = run_dir
    prepared = prepare_run(cfg)
    try:
        return prepared.launcher_for().launch(prepared.spec).result()
    finally:
        let_go(prepared.spec.run_dir)


def _reason(row: Row, cfg) -> str:
    """Why a computing op ran in PyTorch under the kernels section `cfg`."""
    from ops.aten_routes import NAMES
    from trainer.models.kernels import Kernels

    if cfg.name != "triton":
        return "kernels=torch: PyTorch's kernels throughout"
    if Kernels.of(cfg).aten is None:
        return "kernels.aten=false (or an include of model ops only): no ATen op is routed"
    if row.op in NAMES:
        return "left to PyTorch by kernels.include/kernels.exclude"
    return "no kernel of ours for it (not in ops.aten_routes)"


def summary(rows: dict[str, Row]) -> dict:
    """Calls and bytes of the ops that compute (not excluded), and the share of them that ran in ours."""
    computing = [r for r in rows.values() if not r.kind]
    ours = [r for r in computing if r.ours]
    calls = sum(r.calls for r in computing)
    ours_calls = sum(r.ours for r in computing)
    moved = sum(r.bytes for r in computing)
    ours_bytes = sum(r.bytes * r.ours // max(1, r.calls) for r in computing)
    return {"ops": len(computing), "ours_ops": len(ours), "calls": calls, "ours_calls": ours_calls,
            "share": ours_calls / max(1, calls), "bytes": moved, "ours_bytes": ours_bytes}


def trace_run(overrides: list[str], label: str = "", seq: int = 16, batch: int = 2, steps: int = 1) -> Coverage:
    """Train `python -m trainer <overrides>` for `steps` steps of `batch` rows of `seq` tokens in this process
    (a temporary run directory), tracing each step."""
    trace, launches = Trace(), collections.Counter()
    sizes = [f"data.seq_len={seq}", f"train.global_batch_size={batch}", f"train.max_steps={steps}",
             "train.progress=false", "train.log_every=1", f"train.eval_every={steps}", "train.eval_batches=1",
             f"train.checkpoint_every={steps}"]
    with tempfile.TemporaryDirectory(prefix="coverage-") as run_dir, tracing_steps(trace, launches):
        run_cli([*sizes, *overrides], os.path.join(run_dir, "run"))
    kernels = compose([*sizes, *overrides]).kernels
    reasons = {r.op: _reason(r, kernels) for r in trace.rows.values() if not r.kind and r.ours < r.calls}
    return Coverage(label or " ".join(overrides), trace.rows, launches, reasons, summary(trace.rows), trace.rollout)


def table(cov: Coverage) -> str:
    """Every op of the step, PyTorch's first (with the reason), then ours, then the excluded kinds."""
    lines = [f"## {cov.label}", f"{'aten op':<36}{'calls':>7}{'ours':>6}{'MB':>9}  where"]

    def where(r: Row) -> str:
        if r.kind:
            return f"excluded: {r.kind}"
        if r.ours == r.calls:
            return "ours"
        return f"torch: {cov.reasons[r.op]}"

    order = sorted(cov.rows.values(), key=lambda r: (bool(r.kind), r.ours == r.calls, -r.bytes, r.op))
    lines += [f"{r.op:<36}{r.calls:>7}{r.ours:>6}{r.bytes / 2**20:>9.2f}  {where(r)}" for r in order]
    s = cov.summary
    lines.append(f"computing ATen calls in ours: {s['ours_calls']} of {s['calls']} ({s['share']:.1%}); ops "
                 f"{s['ours_ops']} of {s['ops']}; bytes {s['ours_bytes'] / max(1, s['bytes']):.0%}")
    by_reason: dict[str, list[str]] = {}
    for op in sorted(cov.reasons):
        by_reason.setdefault(cov.reasons[op], []).append(op)
    lines.append("left to PyTorch: " + ("; ".join(f"{', '.join(ops)} ({why})" for why, ops in by_reason.items())
                                        if by_reason else "none"))
    lines.append("excluded kinds stay in PyTorch by design: " + "; ".join(f"{k}: {v}" for k, v in WHY.items()))
    lines.append(f"{'our Triton kernel':<36}{'launches':>9}")
    lines += [f"{name:<36}{count:>9}" for name, count in sorted(cov.launches.items())]
    return "\n".join(lines)


def family_overrides(family: str, root: str) -> list[str]:
    """The overrides of one model family: model=debug, or a tiny Hugging Face directory of the family (with a
    tokenizer) written under `root` once."""
    if family == "debug":
        return ["model=debug"]
    from tests.trainer.hf_models import make_named

    return ["model=hf", f"model.path={make_named(root, family)}"]


def recipe_overrides(recipe: str, model: list[str], root: str) -> list[str]:
    """The overrides (and the data file written under `root`) of one recipe, as its tests run it."""
    import json
    import random

    from tests.trainer.hf_models import SAMPLE, add_tokenizer, make_qwen2

    if recipe == "pretrain":
        return []
    if model == ["model=debug"]:
        raise ValueError(f"recipe={recipe} needs a tokenizer: a Hugging Face family, not debug")
    rng = random.Random(0)
    path = os.path.join(root, f"{recipe}.jsonl")
    if recipe in ("sft", "kd"):
        rows = [{"messages": [{"role": "user", "content": rng.choice(SAMPLE)[:20]},
                              {"role": "assistant", "content": rng.choice(SAMPLE)}]} for _ in range(20)]
    elif recipe == "dpo":
        rows = [{"prompt": rng.choice(SAMPLE)[:30], "chosen": "I am fine, thank you.", "rejected": "def main(): 42"}
                for _ in range(20)]
    else:
        rows = [{"prompt": " ".join(rng.choice(["the", "cat", "sat", "on"]) for _ in range(3)), "target": 3}
                for _ in range(20)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    data = {"sft": "chat", "kd": "chat", "dpo": "preference", "grpo": "prompts"}[recipe]
    extra = []
    if recipe == "grpo":
        extra = ["recipe.num_generations=2", "recipe.max_completion_length=4", "recipe.beta=0.04",
                 "recipe.reward_funcs=[tests.trainer.grpo_rewards:lowercase]"]
    if recipe == "kd":
        teacher = os.path.join(root, "teacher", "qwen2")
        if not os.path.isdir(teacher):
            add_tokenizer(make_qwen2(os.path.dirname(teacher)))
        extra = [f"recipe.teacher.path={teacher}", "recipe.kd.chunk_tokens=16"]
    return [f"recipe={recipe}", f"data={data}", f"data.path={path}", "data.eval_percent=20", *extra]


@dataclasses.dataclass
class Measured:
    """One row of the table: a family, its model.impl and recipe under one kernels= (GRPO's rollout, the
    generation path, a row of its own), traced, or the one line `python -m trainer` refused it with."""

    family: str
    impl: str
    recipe: str  # pretrain, sft, dpo, grpo, kd, or generation (GRPO's rollout)
    kernels: str
    rows: dict[str, Row] = dataclasses.field(default_factory=dict)
    refused: str = ""

    @property
    def share(self) -> float:
        return summary(self.rows)["share"]

    @property
    def left(self) -> list[str]:
        """The computing ops that ran in PyTorch, at least once."""
        return sorted(r.op for r in self.rows.values() if not r.kind and r.ours < r.calls)

    def line(self) -> str:
        label = f"{self.family:<10}{self.impl:<13}{self.recipe:<11}{self.kernels:<8}"
        if self.refused:
            return f"{label}{'-':>13}{'-':>7}  refused: {self.refused}"
        s = summary(self.rows)
        return f"{label}{s['ours_calls']:>6}/{s['calls']:<6}{s['share']:>7.1%}  {', '.join(self.left) or '-'}"


def _refusal(run) -> str:
    """Run `run()`; the line it was refused with ('' when it ran). A config error prints `error: ...` and
    exits 2; a model that cannot take an option raises."""
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            run()
    except SystemExit as e:
        lines = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
        return lines[-1] if lines else f"exit {e.code}"
    except Exception as e:  # the row says why it did not run, and the table goes on
        import traceback

        traceback.print_exc(file=err)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        sys.stderr.write(err.getvalue())
    return ""


def measure(family: str, impl: str, recipe: str, root: str, kernels: str = "triton", seq: int = 16,
            batch: int = 2, steps: int = 1, overrides: tuple[str, ...] = (), show=None) -> list[Measured]:
    """The rows of one run: `family` (models written under `root`) with `model.impl=impl` trained by `recipe`
    under `kernels=`, as `python -m trainer` runs it; GRPO's adds its rollout as the generation row. `show`
    gets each traced run's whole table."""
    model = family_overrides(family, root)
    impl_override = [] if family == "debug" else [f"model.impl={impl}"]
    needs = NEEDS.get((family, impl), []) if kernels == "triton" else []
    run = [*model, *impl_override, *recipe_overrides(recipe, model, root), f"kernels={kernels}", *needs,
           *overrides]
    # a conversation or a pair needs room for its prompt before any counted token
    seq = seq if recipe in ("pretrain", "grpo") else max(seq, 48)
    traced: list[Coverage] = []
    refused = _refusal(lambda: traced.append(trace_run(run, " ".join(run), seq, batch, steps)))
    if refused:
        return [Measured(family, impl, recipe, kernels, refused=refused)]
    cov = traced[0]
    if show:
        show(table(cov))
    out = [Measured(family, impl, recipe, kernels, cov.rows)]
    if cov.rollout:
        out.append(Measured(family, impl, "generation", kernels, cov.rollout))
    return out


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(families()[1:]),
                        help="model families: debug or trainer/config/families.py's (default: all of these)")
    parser.add_argument("--impl", default=",".join(IMPLS), help=f"model.impl of the families: {', '.join(IMPLS)}")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"recipes: {', '.join(RECIPES)} (grpo's rollout "
                        "is the generation row)")
    parser.add_argument("--kernels", default="triton", help="kernels=... to measure: torch, triton")
    parser.add_argument("--seq", type=int, default=16, help="tokens per row")
    parser.add_argument("--batch", type=int, default=2, help="rows per step")
    parser.add_argument("--steps", type=int, default=1, help="training steps (each traced)")
    parser.add_argument("--quiet", action="store_true", help="only the closing table, not each run's ops")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. kernels.exclude=[mm,addmm,bmm]")
    args = parser.parse_args(argv)
    if args.seq < 1 or args.batch < 1 or args.steps < 1:
        parser.error(f"--seq {args.seq} --batch {args.batch} --steps {args.steps}: each must be at least 1")
    for key in ("families", "kernels", "impl", "recipes"):
        setattr(args, key, getattr(args, key).split(","))
    for key, values, allowed in (("--families", args.families, families()), ("--kernels", args.kernels, KERNELS),
                                 ("--impl", args.impl, IMPLS), ("--recipes", args.recipes, RECIPES)):
        if not values or any(v not in allowed for v in values):
            parser.error(f"{key} {','.join(values)}: each one of {', '.join(allowed)}")
    return args


HEADER = f"{'family':<10}{'model.impl':<13}{'recipe':<11}{'kernels':<8}{'ours/calls':>13}{'share':>7}  left to PyTorch"


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    measured = []
    show = None if args.quiet else (lambda text: print(text, end="\n\n", flush=True))
    with tempfile.TemporaryDirectory(prefix="coverage-models-") as root:
        for family in args.families:
            for impl in args.impl if family != "debug" else ["native"]:
                # model=debug has no tokenizer: pretraining only
                for recipe in args.recipes if family != "debug" else ["pretrain"]:
                    for kernels in args.kernels:
                        rows = measure(family, impl, recipe, root, kernels, args.seq, args.batch, args.steps,
                                       tuple(args.overrides), show)
                        measured += rows
                        for row in rows:
                            print(f"row: {row.line()}", file=sys.stderr, flush=True)
    print(HEADER)
    print("\n".join(row.line() for row in measured))
    below = [m for m in measured if m.kernels == "triton" and not m.refused and m.share < FLOOR]
    print(f"kernels=triton rows below {FLOOR:.0%}: {len(below)} of "
          f"{sum(1 for m in measured if m.kernels == 'triton' and not m.refused)} measured")


if __name__ == "__main__":
    main()
