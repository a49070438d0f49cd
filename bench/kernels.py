"""Kernel speed on the GPU: each op of `ops/`, forward + backward, against PyTorch eager and
`torch.compile`, at Llama-3-8B shapes in bf16.

For each op it prints the time of one forward + backward, the bytes that pass (inputs read and outputs
written, forward and backward) over that time as GB/s against the device's measured copy bandwidth,
and the peak memory. GPU only: on a machine without CUDA it says so and exits 0.

    python bench/kernels.py [--tokens 4096]
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


def cases(tokens: int):
    """(name, make inputs, ours, eager reference)."""
    import ops
    from trainer.models.llama import apply_rotary

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    angles = torch.outer(torch.arange(tokens, device="cuda", dtype=torch.float32),
                         torch.rand(HEAD_DIM // 2, device="cuda"))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    target = torch.randint(0, VOCAB, (tokens,), device="cuda")

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, **bf16) * scale).requires_grad_()

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


def measure(fn, inputs):
    from triton.testing import do_bench

    def step():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(torch.ones_like(out))

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = do_bench(step, warmup=5, rep=30)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    x = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() * 2 / (ms / 1e3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py measures GPU kernels: no CUDA device on this machine, nothing to measure.")
        return
    peak_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {peak_bw:.0f} GB/s; {args.tokens} tokens, bf16, "
          f"forward + backward")
    print(f"{'op':<28}{'ours ms':>9}{'eager ms':>10}{'compile ms':>11}{'vs eager':>9}{'ours GB/s':>10}"
          f"{'of copy':>8}{'ours GB':>8}{'eager GB':>9}")
    for name, make, ours, eager in cases(args.tokens):
        inputs = make()
        moved = 2 * sum(t.numel() * t.element_size() for t in inputs) * 2  # read + write, forward + backward
        t_ours, m_ours = measure(ours, inputs)
        t_eager, m_eager = measure(eager, inputs)
        try:
            t_compiled, _ = measure(torch.compile(eager), inputs)
        except Exception as e:  # report, do not stop the table
            print(f"  ({name}: torch.compile failed: {type(e).__name__})", file=sys.stderr)
            t_compiled = float("nan")
        gbs = moved / (t_ours / 1e3) / 1e9
        print(f"{name:<28}{t_ours:>9.3f}{t_eager:>10.3f}{t_compiled:>11.3f}{t_eager / t_ours:>8.2f}x{gbs:>10.0f}"
              f"{gbs / peak_bw:>8.0%}{m_ours:>8.2f}{m_eager:>9.2f}")


if __name__ == "__main__":
    main()
