"""End-to-end training throughput of one model shape under each kernel backend, in one hand-written loop:
ours with `kernels=torch` and `kernels=triton`, ours under `flag_gems.enable()` (FlagGems' ATen
replacement, PyTorch's kernels elsewhere), and transformers' LlamaForCausalLM at the same shape (what
`model=hf` loads) eager and with Liger-Kernel's `apply_liger_kernel_to_llama`.

Every variant trains the same shape (the config's `model=...`) from random weights on random tokens
with torch's AdamW, bf16 autocast on a GPU, the same batch and sequence length, and reports tokens/s as
the median over 5-step intervals after a warmup. A variant whose package is missing prints `skipped`
with the reason. On a CPU (tests) the Triton variant runs under the interpreter: keep the shapes tiny.

    python bench/e2e.py [--variants torch,triton,gems,hf,hf-liger] [--steps 20] [--warmup 5] [--batch 4]
                        [--seq 2048] [override ...]                         e.g. model=1b
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():  # before triton is imported: it reads this once
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

VARIANTS = ("torch", "triton", "gems", "hf", "hf-liger")
INTERVAL = 5  # steps between clock reads (the only places the loop waits for the device)


class Skipped(Exception):
    """A variant that cannot run here (its package is missing), with the reason."""


def _config(overrides: list[str]):
    from trainer.config.compose import compose

    return compose(overrides)


def _ours(cfg, kernels: str, device: torch.device):
    from trainer import models
    from trainer.config.kernels import KernelsConfig
    from trainer.models.kernels import Kernels

    with torch.device("meta"):
        model = models.build(cfg.model)
    model = Kernels.of(KernelsConfig(name=kernels, aten=False)).apply(model)
    model.to_empty(device=device)
    model.init_buffers()
    return model, lambda tokens: model(tokens[:, :-1], targets=tokens[:, 1:])


def _hf(cfg, liger: bool, device: torch.device):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise Skipped(f"transformers is not installed ({e})") from e
    if liger:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as e:
            raise Skipped(f"liger-kernel is not installed ({e})") from e
        apply_liger_kernel_to_llama()  # patches transformers' Llama modules: before the model is built
    m = cfg.model
    hf_cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                         num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads,
                         max_position_embeddings=m.max_seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
                         tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg)

    def loss(tokens):
        # transformers shifts the labels itself: the same next-token loss over seq tokens.
        return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1], use_cache=False).loss

    return model, loss


def build(variant: str, cfg, device: torch.device):
    """(model, loss of a batch of tokens, context the step runs in) for one variant."""
    if variant in ("torch", "triton"):
        return (*_ours(cfg, variant, device), contextlib.nullcontext)
    if variant == "gems":
        try:
            import flag_gems
        except (ImportError, RuntimeError) as e:  # RuntimeError: it refuses to import without a device
            raise Skipped(f"flag_gems does not import here ({type(e).__name__}: {str(e).splitlines()[0]})") from e
        return (*_ours(cfg, "torch", device), flag_gems.use_gems)
    return (*_hf(cfg, variant == "hf-liger", device), contextlib.nullcontext)


def run(variant: str, cfg, steps: int, warmup: int, batch: int, seq: int) -> float:
    """Tokens per second of `variant`: the median over INTERVAL-step intervals after `warmup` steps."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, loss_fn, context = build(variant, cfg, device)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    vocab = cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    marks = []
    with context():
        for step in range(steps):
            if step >= warmup and (step - warmup) % INTERVAL == 0:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                marks.append(time.perf_counter())
            with autocast:
                loss = loss_fn(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
    intervals = [(b - a) / INTERVAL for a, b in itertools.pairwise(marks)][: max(1, (steps - warmup) // INTERVAL)]
    if not torch.isfinite(loss.detach()):
        raise RuntimeError(f"{variant}: the loss is {loss.item()}")
    return batch * seq / statistics.median(intervals)


def line(model: str, variant: str, rate: str, note: str = "") -> str:
    """One result line (bench/gpu_report.py reads it back): model, variant, tokens/s or `skipped`."""
    return f"{model:<8}{variant:<10}{rate:>12}" + (f"  {note}" if note else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model=1b")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.warmup < 0 or args.steps < args.warmup + INTERVAL or args.batch < 1 or args.seq < 1:
        parser.error(f"--steps {args.steps} --warmup {args.warmup} --batch {args.batch} --seq {args.seq}: need "
                     f"steps >= warmup + {INTERVAL}, warmup >= 0, batch and seq >= 1")
    cfg = _config(args.overrides)
    model = cfg.model.name
    print(f"{'model':<8}{'variant':<10}{'tokens/s':>12}  (batch {args.batch} x seq {args.seq}, "
          f"median of {INTERVAL}-step intervals after {args.warmup} steps)")
    for variant in variants:
        try:
            rate = run(variant, cfg, args.steps, args.warmup, args.batch, args.seq)
            print(line(model, variant, f"{rate:.0f}"), flush=True)
        except Skipped as e:
            print(line(model, variant, "skipped", str(e)), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
