"""Kernel speed on the GPU: each op of `ops/`, forward + backward, against PyTorch eager and
`torch.compile`, at Llama-3-8B shapes, in bf16 and fp32.

For each op it prints the time of one forward + backward, the bytes that pass (inputs read and written
once forward and once backward) over that time as GB/s against the device's measured copy bandwidth,
and the peak memory above the inputs. `--check` first compares each op's output and input gradients with
eager's at the same shapes, against an fp32 (fp64 for fp32 inputs) reference of the same computation:
ours must be as close to the reference as eager is (within 2x plus one rounding), so a fast wrong kernel
cannot hide. GPU only: on a machine without CUDA it says so and exits 0.

    python bench/kernels.py [--tokens 4096] [--dtypes bf16,fp32] [--ops rms_norm,...] [--check]
                            [--compile-dtypes bf16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DIM, FFN, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 128256, 32, 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def cases(tokens: int, dtype: torch.dtype):
    """(name, make inputs, ours, eager reference)."""
    import ops
    from trainer.models.llama import apply_rotary

    spec = {"device": "cuda", "dtype": dtype}
    angles = torch.outer(torch.arange(tokens, device="cuda", dtype=torch.float32),
                         torch.rand(HEAD_DIM // 2, device="cuda"))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    target = torch.randint(0, VOCAB, (tokens,), device="cuda")

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, **spec) * scale).requires_grad_()

    return [
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
    ]


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


def check(ours, eager, inputs) -> str:
    """Compare ours and eager with a wider-precision reference; return 'ok' or what differs."""
    wide = torch.float64 if inputs[0].dtype == torch.float32 else torch.float32
    refs = [t.detach().to(wide).requires_grad_() for t in inputs]
    grad = torch.randn_like(eager(*refs))
    expected = _step(eager, refs, grad)
    scales = [expected.abs().max().item()] + [r.grad.abs().max().item() for r in refs]
    errors = {}
    for label, fn in (("ours", ours), ("eager", eager)):
        out = _step(fn, inputs, grad)
        errors[label] = [(out.to(wide) - expected).abs().max().item()]
        errors[label] += [(t.grad.to(wide) - r.grad).abs().max().item() for t, r in zip(inputs, refs, strict=True)]
    eps = torch.finfo(inputs[0].dtype).eps
    bad = []
    for i, (mine, theirs, scale) in enumerate(zip(errors["ours"], errors["eager"], scales, strict=True)):
        if mine > 2 * theirs + 2 * eps * scale:
            what = "output" if i == 0 else f"grad of input {i - 1}"
            bad.append(f"{what}: ours {mine:.3g} vs eager {theirs:.3g} (max |ref| {scale:.3g})")
    return "ok" if not bad else "WRONG " + "; ".join(bad)


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    x = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() * 2 / (ms / 1e3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtypes", default="bf16,fp32", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--check", action="store_true", help="compare each op with eager first")
    parser.add_argument("--compile-dtypes", default="bf16",
                        help="dtypes whose rows also time torch.compile (compiling costs ~10 s an op)")
    args = parser.parse_args()
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: unknown {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    if not torch.cuda.is_available():
        print("bench/kernels.py measures GPU kernels: no CUDA device on this machine, nothing to measure.")
        return
    peak_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {peak_bw:.0f} GB/s; {args.tokens} tokens, "
          f"forward + backward; TF32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'} for fp32 matmuls")
    header = (f"{'op':<28}{'dtype':>6}{'ours ms':>9}{'eager ms':>10}{'compile ms':>11}{'vs eager':>9}"
              f"{'vs compile':>11}{'ours GB/s':>10}{'of copy':>8}{'ours GB':>8}{'eager GB':>9}")
    header += "  check" if args.check else ""
    print(header)
    chosen = set(filter(None, args.ops.split(",")))
    for dtype_name in args.dtypes.split(","):
        for name, make, ours, eager in cases(args.tokens, DTYPES[dtype_name]):
            if chosen and name not in chosen:
                continue
            inputs = make()
            verdict = check(ours, eager, inputs) if args.check else ""
            moved = 2 * sum(t.numel() * t.element_size() for t in inputs) * 2
            t_ours, m_ours = measure(ours, inputs)
            t_eager, m_eager = measure(eager, inputs)
            t_compiled = float("nan")
            if dtype_name in args.compile_dtypes.split(","):
                torch._dynamo.reset()
                try:
                    t_compiled, _ = measure(torch.compile(eager, dynamic=False), inputs)
                except Exception as e:  # report, do not stop the table
                    print(f"  ({name}: torch.compile failed: {type(e).__name__})", file=sys.stderr)
            gbs = moved / (t_ours / 1e3) / 1e9
            print(f"{name:<28}{dtype_name:>6}{t_ours:>9.3f}{t_eager:>10.3f}{t_compiled:>11.3f}"
                  f"{t_eager / t_ours:>8.2f}x{t_compiled / t_ours:>10.2f}x{gbs:>10.0f}{gbs / peak_bw:>8.0%}"
                  f"{m_ours:>8.2f}{m_eager:>9.2f}" + (f"  {verdict}" if args.check else ""))
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
