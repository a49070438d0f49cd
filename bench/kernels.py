"""Kernel speed on the GPU: each op of `ops/`, forward + backward, against PyTorch eager, `torch.compile`,
Liger-Kernel and FlagGems, at Llama-3-8B shapes, in bf16 and fp32.

For each op it prints the time of one forward + backward, the bytes that pass (inputs read and written
once forward and once backward) over that time as GB/s against the device's measured copy bandwidth,
and the peak memory above the inputs. The peers: Liger-Kernel's function for the op where it has one
(`liger_rms_norm`, `liger_rope`, `liger_swiglu`, ...; its GEGLU is the tanh form, so not ours), and
FlagGems as `flag_gems.use_gems()` gives it, the eager reference run with every ATen op FlagGems has
replaced by its kernel; `vs peer` is ours against the faster of the two. Attention runs at
`--attn-seq` tokens (32 query and 8 key/value heads of 128, causal) against PyTorch's flash SDPA (K/V
repeated, as flash takes them) in 16 bits. `--check` first compares each op's output and input
gradients, ours and the peers', with an fp32 (fp64 for fp32 inputs) reference of the same computation:
ours must be as close to the reference as eager is (within 2x plus one rounding), so a fast wrong kernel
cannot hide; the peers' largest errors are printed beside ours. GPU only: on a machine without CUDA it
says so and exits 0 (FlagGems does not even import there).

    python bench/kernels.py [--tokens 4096] [--attn-seq 8192] [--dtypes bf16,fp32] [--ops rms_norm,...]
                            [--check] [--compile-dtypes bf16] [--peers liger,gems]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

DIM, FFN, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 128256, 32, 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _flash_sdpa(q, k, v):
    """PyTorch's attention with K/V heads repeated: the flash backend in 16 bits, its choice in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    backends = [SDPBackend.FLASH_ATTENTION] if q.dtype != torch.float32 else [SDPBackend.EFFICIENT_ATTENTION,
                                                                              SDPBackend.MATH]
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cases(tokens: int, dtype: torch.dtype, attn_seq: int = 8192, device: str = "cuda"):
    """(name, make inputs, ours, eager reference, Liger's function or None)."""
    import ops
    from trainer.models.llama import apply_rotary

    spec = {"device": device, "dtype": dtype}
    angles = torch.outer(torch.arange(tokens, device=device, dtype=torch.float32),
                         torch.rand(HEAD_DIM // 2, device=device))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    target = torch.randint(0, VOCAB, (tokens,), device=device)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, **spec) * scale).requires_grad_()

    liger = liger_ops(cos, sin, target)
    return [(*case, liger.get(case[0])) for case in [
        ("rms_norm", lambda: [leaf(tokens, DIM), leaf(DIM)], lambda x, w: ops.rms_norm(x, (DIM,), w, 1e-5),
         lambda x, w: F.rms_norm(x, (DIM,), w, 1e-5)),
        ("layer_norm", lambda: [leaf(tokens, DIM), leaf(DIM), leaf(DIM)],
         lambda x, w, b: ops.layer_norm(x, (DIM,), w, b), lambda x, w, b: F.layer_norm(x, (DIM,), w, b)),
        ("rotary_embedding", lambda: [leaf(1, tokens, HEADS, HEAD_DIM), leaf(1, tokens, KV_HEADS, HEAD_DIM)],
         lambda q, k: torch.cat([t.flatten() for t in ops.rotary_embedding(q, k, cos, sin)]),
         lambda q, k: torch.cat([t.flatten() for t in apply_rotary(q, k, cos, sin)])),
        ("silu_and_mul", lambda: [leaf(tokens, FFN), leaf(tokens, FFN)], ops.silu_and_mul,
         lambda x, y: F.silu(x) * y),
        ("gelu_and_mul", lambda: [leaf(tokens, FFN), leaf(tokens, FFN)], ops.gelu_and_mul,
         lambda x, y: F.gelu(x) * y),
        ("silu", lambda: [leaf(tokens, FFN)], ops.silu, F.silu),
        ("gelu", lambda: [leaf(tokens, FFN)], ops.gelu, F.gelu),
        ("softmax", lambda: [leaf(tokens, VOCAB)], ops.softmax, lambda x: torch.softmax(x, -1)),
        ("log_softmax", lambda: [leaf(tokens, VOCAB)], ops.log_softmax, lambda x: torch.log_softmax(x, -1)),
        ("cross_entropy", lambda: [leaf(tokens, VOCAB)], lambda x: ops.cross_entropy(x, target),
         lambda x: F.cross_entropy(x.float(), target)),
        ("fused_linear_cross_entropy", lambda: [leaf(tokens, DIM), leaf(VOCAB, DIM, scale=0.02)],
         lambda h, w: ops.fused_linear_cross_entropy(h, w, target),
         lambda h, w: F.cross_entropy((h @ w.t()).float(), target)),
        ("addmm", lambda: [leaf(DIM), leaf(tokens, DIM), leaf(DIM, DIM, scale=0.02)], ops.addmm, torch.addmm),
        ("mm", lambda: [leaf(tokens, DIM), leaf(DIM, DIM, scale=0.02)], ops.mm, torch.mm),
        ("bmm", lambda: [leaf(HEADS, tokens, HEAD_DIM), leaf(HEADS, HEAD_DIM, tokens, scale=0.1)], ops.bmm,
         torch.bmm),
        ("embedding", lambda: [leaf(VOCAB, DIM)], lambda w: ops.embedding(target, w), lambda w: F.embedding(target, w)),
        # The residual add, a scale by a broadcast row, and a bias gradient's column sum: the elementwise
        # ops and reductions of the step (FlagGems has each; Liger has none). The elementwise ops are ours
        # as the step runs them: torch's own, routed to our kernels (ROUTED), forward and backward.
        ("add", lambda: [leaf(tokens, DIM), leaf(tokens, DIM)], torch.add, torch.add),
        ("mul", lambda: [leaf(tokens, DIM), leaf(DIM)], torch.mul, torch.mul),
        ("sum", lambda: [leaf(tokens, DIM)], lambda x: ops.sum(x, 0), lambda x: torch.sum(x, 0)),
        ("scaled_dot_product_attention",
         lambda: [leaf(1, HEADS, attn_seq, HEAD_DIM), leaf(1, KV_HEADS, attn_seq, HEAD_DIM),
                  leaf(1, KV_HEADS, attn_seq, HEAD_DIM)],
         lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), _flash_sdpa),
    ]]


# Cases whose `ours` is torch's function with these ops routed to our kernels (`ops.use_kernels`), as
# FlagGems' column is eager under `use_gems()`.
ROUTED = {"add": ["add"], "mul": ["mul"]}


def ours_context(name: str):
    """What `ours` of the case `name` runs under: the routing of its ATen ops, or nothing."""
    import ops

    if name in ROUTED:
        return lambda: ops.use_kernels(include=ROUTED[name])
    return contextlib.nullcontext


def liger_ops(cos: torch.Tensor, sin: torch.Tensor, target: torch.Tensor) -> dict:
    """Liger-Kernel's function for each op it has, called as our case calls ours, with the same rotary
    tables and targets (empty where Liger is not installed)."""
    try:
        from liger_kernel.transformers import functional as lk
    except ImportError:
        return {}

    def rope(q, k):  # Liger takes (batch, heads, seq, dim) and tables (1, seq, dim)
        out = lk.liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos[None].to(q.dtype), sin[None].to(q.dtype))
        return torch.cat([t.transpose(1, 2).flatten() for t in out])

    return {
        "rms_norm": lambda x, w: lk.liger_rms_norm(x, w, 1e-5, in_place=False),
        "layer_norm": lambda x, w, b: lk.liger_layer_norm(x, w, b, 1e-5),
        "rotary_embedding": rope,
        "silu_and_mul": lk.liger_swiglu,
        "softmax": lk.liger_softmax,
        "cross_entropy": lambda x: lk.liger_cross_entropy(x, target),
        "fused_linear_cross_entropy": lambda h, w: lk.liger_fused_linear_cross_entropy(h, w, target),
    }


def gems_context():
    """FlagGems' ATen replacement as a context manager, or None where it is not installed."""
    try:
        import flag_gems
    except Exception as e:  # missing, or refusing this machine (no device, another torch): no gems column
        print(f"  (flag_gems does not import here: {type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        return None
    return flag_gems.use_gems


def _step(fn, inputs, grad=None):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.backward(torch.ones_like(out) if grad is None else grad.to(out.dtype))
    return out


def measure(fn, inputs):
    """Milliseconds per forward + backward (triton's do_bench: median, L2 flushed), and GB of peak memory
    of one step above what was allocated before it (the inputs; their gradients are released first)."""
    from triton.testing import do_bench

    for _ in range(3):  # compile, autotune, allocate
        _step(fn, inputs)
    ms = do_bench(lambda: _step(fn, inputs), warmup=10, rep=50)
    for t in inputs:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(fn, inputs)  # measured apart from do_bench, whose L2-flush buffer would count otherwise
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def check(ours, eager, inputs, peers: dict, context=contextlib.nullcontext) -> str:
    """Compare ours (run under `context`), eager and each peer ({name: (fn, context)}) with a wider-precision
    reference; 'ok' or what differs, then the largest error of each (output and gradients together)."""
    wide = torch.float64 if inputs[0].dtype == torch.float32 else torch.float32
    refs = [t.detach().to(wide).requires_grad_() for t in inputs]
    grad = torch.randn_like(eager(*refs))
    expected = _step(eager, refs, grad)
    scales = [expected.abs().max().item()] + [r.grad.abs().max().item() for r in refs]
    errors = {}
    runs = {"ours": (ours, context), "eager": (eager, contextlib.nullcontext), **peers}
    failed = []
    for label, (fn, context) in runs.items():
        try:
            with context():
                out = _step(fn, inputs, grad)
        except Exception as e:  # a peer that cannot run this op at this shape; ours and eager must
            if label in ("ours", "eager"):
                raise
            failed.append(f"{label} failed ({type(e).__name__})")
            continue
        errors[label] = [(out.to(wide) - expected).abs().max().item()]
        errors[label] += [(t.grad.to(wide) - r.grad).abs().max().item() for t, r in zip(inputs, refs, strict=True)]
    eps = torch.finfo(inputs[0].dtype).eps
    bad = []
    for i, (mine, theirs, scale) in enumerate(zip(errors["ours"], errors["eager"], scales, strict=True)):
        if mine > 2 * theirs + 2 * eps * scale:
            what = "output" if i == 0 else f"grad of input {i - 1}"
            bad.append(f"{what}: ours {mine:.3g} vs eager {theirs:.3g} (max |ref| {scale:.3g})")
    largest = " ".join([f"{label} {max(e):.2g}" for label, e in errors.items()] + failed)
    return ("ok" if not bad else "WRONG " + "; ".join(bad)) + f" [max err: {largest}]"


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    x = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() * 2 / (ms / 1e3) / 1e9


def _time(fn, inputs, context=contextlib.nullcontext) -> float:
    """ms per forward + backward under `context`, or NaN (said on stderr) where the peer fails."""
    try:
        with context():
            return measure(fn, inputs)[0]
    except Exception as e:  # a peer without this op or dtype: report, do not stop the table
        print(f"  ({getattr(fn, '__name__', fn)}: {type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--attn-seq", type=int, default=8192, help="tokens of the attention case")
    parser.add_argument("--dtypes", default="bf16,fp32", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--check", action="store_true", help="compare each op with eager (and the peers) first")
    parser.add_argument("--compile-dtypes", default="bf16",
                        help="dtypes whose rows also time torch.compile (compiling costs ~10 s an op)")
    parser.add_argument("--peers", default="liger,gems", help="which of liger, gems to time beside ours")
    parser.add_argument("--aten", action="store_true", help="instead: the ATen table's ops (see aten_table)")
    args = parser.parse_args()
    if args.aten:
        return aten_table(args.tokens, [DTYPES[d] for d in args.dtypes.split(",")], {*args.ops.split(",")} - {""},
                          "gems" in args.peers)
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: unknown {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    peers = set(filter(None, args.peers.split(",")))
    if peers - {"liger", "gems"}:
        parser.error(f"--peers: unknown {', '.join(sorted(peers - {'liger', 'gems'}))}; choose from liger, gems")
    if args.tokens < 1 or args.attn_seq < 1:
        parser.error(f"--tokens {args.tokens} --attn-seq {args.attn_seq}: both must be at least 1")
    if not torch.cuda.is_available():
        print("bench/kernels.py measures GPU kernels: no CUDA device on this machine, nothing to measure.")
        return
    gems = gems_context() if "gems" in peers else None
    peak_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {peak_bw:.0f} GB/s; {args.tokens} tokens "
          f"(attention {args.attn_seq}), forward + backward; TF32 "
          f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'} for fp32 matmuls; peers: "
          f"liger {'yes' if 'liger' in peers and importlib.util.find_spec('liger_kernel') else 'no'}, "
          f"gems {'yes' if gems else 'no'}")
    print(HEADER + ("  check" if args.check else ""))
    chosen = set(filter(None, args.ops.split(",")))
    for dtype_name in args.dtypes.split(","):
        for name, make, ours, eager, liger in cases(args.tokens, DTYPES[dtype_name], args.attn_seq):
            if chosen and name not in chosen:
                continue
            liger = liger if "liger" in peers else None
            inputs = make()
            runs = {**({"liger": (liger, contextlib.nullcontext)} if liger else {}),
                    **({"gems": (eager, gems)} if gems else {})}
            verdict = check(ours, eager, inputs, runs, ours_context(name)) if args.check else ""
            moved = 2 * sum(t.numel() * t.element_size() for t in inputs) * 2
            with ours_context(name)():
                t_ours, m_ours = measure(ours, inputs)
            t_eager, m_eager = measure(eager, inputs)
            t_compiled = float("nan")
            if dtype_name in args.compile_dtypes.split(","):
                torch._dynamo.reset()
                t_compiled = _time(torch.compile(eager, dynamic=False), inputs)
            t_liger = _time(liger, inputs) if liger else float("nan")
            t_gems = _time(eager, inputs, gems) if gems else float("nan")
            gbs = moved / (t_ours / 1e3) / 1e9
            print(row(name, dtype_name, t_ours, t_eager, t_compiled, t_liger, t_gems, gbs / peak_bw, gbs, m_ours,
                      m_eager) + (f"  {verdict}" if args.check else ""))
            del inputs
            torch.cuda.empty_cache()


def row(name: str, dtype: str, t_ours: float, t_eager: float, t_compiled: float, t_liger: float, t_gems: float,
        of_copy: float, gbs: float, m_ours: float, m_eager: float) -> str:
    """One line of the table (times in ms, NaN where not measured); bench/gpu_report.py reads it back."""
    best_peer = min((t for t in (t_liger, t_gems) if t == t), default=float("nan"))
    return (f"{name:<30}{dtype:>6}{t_ours:>9.3f}{t_eager:>10.3f}{t_compiled:>11.3f}{t_liger:>10.3f}{t_gems:>9.3f}"
            f"{t_eager / t_ours:>8.2f}x{t_compiled / t_ours:>10.2f}x{best_peer / t_ours:>8.2f}x{gbs:>10.0f}"
            f"{of_copy:>8.0%}{m_ours:>8.2f}{m_eager:>9.2f}")


def aten_cases(tokens: int, dtype: torch.dtype, device: str):
    """(op, the call through PyTorch's API, its inputs) for each routed ATen op that takes one tensor, two
    (the second broadcast over rows), or reduces/scans the last dimension: the ATen table's pointwise,
    reduction and scan rows."""
    import inspect

    from ops.catalog import rows
    from ops.pointwise_ops import SPECS

    x = torch.randn(tokens, DIM, device=device, dtype=dtype)
    y = torch.randn(DIM, device=device, dtype=dtype)
    positive = x.abs() + 0.1
    reductions = {"sum", "mean", "amax", "amin", "prod", "var", "std", "logsumexp", "argmax", "argmin", "all", "any",
                  "nansum", "count_nonzero", "cumsum", "cumprod", "cummax", "cummin", "sort"}
    arity = {name: len(inspect.signature(body.fn).parameters) for name, (body, _) in SPECS.items()}
    cases = []
    for row in rows():
        fn = getattr(torch, row.op, None)
        if fn is None:
            continue
        if row.op in reductions:
            cases.append((row.op, lambda t, fn=fn: fn(t, -1), [x]))
        elif row.op == "topk":  # a sampler's top-k over the last dimension
            cases.append((row.op, lambda t: torch.topk(t, 50, -1), [x]))
        elif arity.get(row.op) == 1 and not row.op.startswith("bitwise"):
            cases.append((row.op, fn, [positive]))
        elif arity.get(row.op) == 2 and not row.op.startswith("bitwise"):
            cases.append((row.op, fn, [x, y]))
    return cases


def aten_table(tokens: int, dtypes: list[torch.dtype], chosen: set[str], gems: bool) -> None:
    """Forward time of each routed ATen op of one or two tensors, or reducing/scanning the last dimension, at
    --tokens x 4096: ours (ops.use_kernels(include=[op])), eager and FlagGems. Without a GPU it prints the rows
    with the time columns not measured."""
    import ops

    cuda = torch.cuda.is_available()
    gems_ctx = gems_context() if gems and cuda else None
    print(f"{'aten op':<22}{'dtype':>6}{'ours ms':>10}{'eager ms':>10}{'gems ms':>10}{'vs eager':>10}")
    for dtype in dtypes:
        name = next(k for k, v in DTYPES.items() if v == dtype)
        for op, fn, inputs in aten_cases(tokens if cuda else 2, dtype, "cuda" if cuda else "cpu"):
            if chosen and op not in chosen:
                continue
            if not cuda:
                print(f"{op:<22}{name:>6}{'not measured (no GPU)':>40}")
                continue
            from triton.testing import do_bench

            def timed(context, fn=fn, inputs=inputs):
                try:
                    with context():
                        return do_bench(lambda: fn(*inputs), warmup=5, rep=20)
                except Exception:  # an op a peer lacks at this dtype: not a number, the table goes on
                    return float("nan")

            t_ours = timed(lambda op=op: ops.use_kernels(include=[op]))
            t_eager = timed(contextlib.nullcontext)
            t_gems = timed(gems_ctx) if gems_ctx else float("nan")
            print(f"{op:<22}{name:>6}{t_ours:>10.3f}{t_eager:>10.3f}{t_gems:>10.3f}{t_eager / t_ours:>9.2f}x")


# The table's columns, in the order of `row`.
HEADER = (f"{'op':<30}{'dtype':>6}{'ours ms':>9}{'eager ms':>10}{'compile ms':>11}{'liger ms':>10}{'gems ms':>9}"
          f"{'vs eager':>9}{'vs compile':>11}{'vs peer':>9}{'ours GB/s':>10}{'of copy':>8}{'ours GB':>8}"
          f"{'eager GB':>9}")


if __name__ == "__main__":
    main()
