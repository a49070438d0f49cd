"""Every Triton kernel specialisation the op tests launch, recorded under the interpreter and compiled for
real GPUs on a machine without one.

`Recorder` records each launch the interpreter runs (tests/ops/conftest.py installs one while the op
tests run, writing to $TRAINJOB_RECORD_LAUNCHES or a file of the session's), and `python -m
tests.ops.launches record-model-shapes <file>` records, without running them, the launches at a real
model's shapes: the kernel, each argument's Triton type and 16-byte divisibility (as a GPU launch would
specialise them), the constexpr values and the launch options (`num_warps`, `num_stages`). As a program
(`python -m tests.ops.launches <file> 90 80`, TRITON_INTERPRET unset), it compiles each recorded
specialisation with `triton.compile` for those architectures down to a cubin, checks that its shared
memory fits the architecture, and prints one line per failure.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

RECORD_ENV = "TRAINJOB_RECORD_LAUNCHES"
# With this set too, recorded launches are not run: how launches at full model shapes are recorded
# without the interpreter spending hours on them (their outputs are then garbage, which nothing reads).
RECORD_ONLY_ENV = "TRAINJOB_RECORD_ONLY"
# Shared memory one program may use (bytes), as `cudaDevAttrMaxSharedMemoryPerBlockOptin` reports it.
SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
OPTIONS = ("num_warps", "num_stages")


def _ref(fn) -> dict:
    """Where a @triton.jit function can be found again: module and qualified name."""
    inner = getattr(fn, "fn", fn)
    return {"module": inner.__module__, "name": inner.__qualname__}


def _resolve(ref: dict):
    """The @triton.jit function a recorded reference names (a pointwise op gives its scalar function)."""
    obj = importlib.import_module(ref["module"])
    for part in ref["name"].split("."):
        if part == "<locals>":
            raise LookupError(f"{ref['module']}:{ref['name']} is local to a function: define it at module level "
                              "so that its launches can be compiled")
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)


def _describe(value):
    """A constexpr value as JSON: plain values as they are, jit functions by reference."""
    import triton.language as tl

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    if hasattr(value, "fn") or hasattr(value, "arg_names"):
        return {"jit": _ref(value)}
    raise TypeError(f"cannot record constexpr value {value!r}")


def _constant(value):
    """A recorded constexpr value as the compiler takes it."""
    import triton.language as tl

    if isinstance(value, dict) and "jit" in value:
        return _resolve(value["jit"])
    if isinstance(value, dict) and "dtype" in value:
        return tl.dtype(value["dtype"])
    return value


class Recorder:
    """Wraps the interpreter's launch to write each new specialisation to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: set[str] = set()
        self._run = None  # the interpreter's own launch, while installed

    def install(self) -> None:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
        from triton.runtime.interpreter import InterpretedFunction

        run = self._run = InterpretedFunction.run
        recorder = self

        def recording_run(fn, *args, grid, warmup, **kwargs):
            import inspect

            params = inspect.signature(fn.fn).parameters
            # Arguments the kernel names in `do_not_specialize` get no value or alignment specialisation.
            plain = set(fn.kwargs.get("do_not_specialize") or [])
            bound = dict(zip(fn.arg_names, args, strict=False))  # the rest come as keywords
            bound.update({k: v for k, v in kwargs.items() if k in params})
            signature, constexprs, aligned = {}, {}, []
            for i, (name, param) in enumerate(params.items()):
                value = bound.get(name, param.default)
                if "constexpr" in str(param.annotation):
                    signature[name] = "constexpr"
                    constexprs[name] = _describe(value)
                    continue
                free = name in plain or i in plain
                kind, attr = native_specialize_impl(BaseBackend, value, False, not free, not free)
                signature[name] = kind
                if kind == "constexpr":  # an int equal to 1 is specialised as a constant, as on a GPU
                    constexprs[name] = value
                elif attr == "D":
                    aligned.append(i)
            options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
            spec = {"kernel": _ref(fn), "signature": signature, "constexprs": constexprs, "aligned": aligned,
                    "options": options}
            key = json.dumps(spec, sort_keys=True)
            if key not in recorder.seen:
                recorder.seen.add(key)
                with open(recorder.path, "a") as f:
                    f.write(key + "\n")
            if os.environ.get(RECORD_ONLY_ENV) == "1":
                return None
            return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run

    def uninstall(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run, self._run = self._run, None


def _reason(error: Exception) -> str:
    """The compiler's own complaint: a CompilationError wraps it (NameError, ...) under a source excerpt."""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def compile_spec(spec: dict, archs: list[int]) -> list[str]:
    """Compile one recorded specialisation for each architecture; one line per failure."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    label = f"{spec['kernel']['module']}:{spec['kernel']['name']} {spec['constexprs']} {spec['options']}"
    try:
        kernel = _resolve(spec["kernel"])
        constexprs = {k: _constant(v) for k, v in spec["constexprs"].items()}
    except (LookupError, AttributeError, ImportError) as e:
        return [f"{label}: {e}"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in spec["aligned"]}
    failures = []
    for arch in archs:
        source = ASTSource(fn=kernel, signature=spec["signature"], constexprs=constexprs, attrs=attrs)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=spec["options"])
        except Exception as e:  # every compiler error is a finding, reported with its kernel
            failures.append(f"sm_{arch} {label}: {_reason(e)}")
            continue
        if "cubin" not in compiled.asm:
            failures.append(f"sm_{arch} {label}: no cubin produced")
        elif compiled.metadata.shared > SHARED_MEMORY[arch]:
            failures.append(f"sm_{arch} {label}: needs {compiled.metadata.shared} bytes of shared memory, "
                            f"the device has {SHARED_MEMORY[arch]}")
    return failures


def record_model_shapes(path: str) -> None:
    """Record, without running, every op forward and backward at Llama-3-8B's row lengths (hidden 4096,
    FFN 14336, vocabulary 128256, 32/8 heads of 128), a 1024-cube matmul, attention, the embedding, the
    loss's comparisons, clamps and reciprocals, an AdamW step and gradient clipping, in bf16 and fp32: the
    block sizes, warps and tiles a GPU uses at those shapes, which the op tests' small shapes never
    reach. (The fused linear cross-entropy's kernels are the cross-entropy ones at the same vocabulary.)"""
    import torch

    import ops

    Recorder(path).install()
    os.environ[RECORD_ONLY_ENV] = "1"
    tokens, dim, ffn, vocab, heads, kv_heads, head_dim = 64, 4096, 14336, 128256, 32, 8, 128
    target = torch.zeros(tokens, dtype=torch.long)
    cos = sin = torch.zeros(tokens, head_dim)
    for dtype in (torch.bfloat16, torch.float32):
        def leaf(*shape, dtype=dtype):
            return torch.zeros(*shape, dtype=dtype).requires_grad_()

        calls = [
            (lambda x, w: ops.rms_norm(x, (dim,), w, 1e-5), [leaf(tokens, dim), leaf(dim)]),
            (lambda x, w, b: ops.layer_norm(x, (dim,), w, b), [leaf(tokens, dim), leaf(dim), leaf(dim)]),
            (lambda q, k: torch.cat([t.flatten() for t in ops.rotary_embedding(q, k, cos, sin)]),
             [leaf(1, tokens, heads, head_dim), leaf(1, tokens, kv_heads, head_dim)]),
            (lambda q, k: torch.cat([t.flatten() for t in ops.rotary_embedding(q, k, cos[None], sin[None])]),
             [leaf(1, tokens, heads, head_dim), leaf(1, tokens, kv_heads, head_dim)]),  # per-row tables
            (ops.silu_and_mul, [leaf(tokens, ffn), leaf(tokens, ffn)]),
            (ops.gelu_and_mul, [leaf(tokens, ffn), leaf(tokens, ffn)]),
            (ops.silu, [leaf(tokens, ffn)]),
            (ops.gelu, [leaf(tokens, ffn)]),
            (lambda x: ops.softmax(x, -1), [leaf(tokens, vocab)]),
            (lambda x: ops.log_softmax(x, -1), [leaf(tokens, vocab)]),
            (lambda x: ops.cross_entropy(x, target), [leaf(tokens, vocab)]),
            (ops.addmm, [leaf(1024), leaf(1024, 1024), leaf(1024, 1024)]),
            (lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             [leaf(1, heads, tokens, head_dim)] + [leaf(1, kv_heads, tokens, head_dim) for _ in "kv"]),
            (lambda w: ops.embedding(target, w), [leaf(vocab, dim)]),
            (ops.bmm, [leaf(heads, tokens, head_dim), leaf(heads, head_dim, tokens)]),
            (lambda x: ops.sum(x, 0), [leaf(tokens, vocab)]),
        ]
        for fn, inputs in calls:
            out = fn(*inputs)
            out.backward(torch.ones_like(out))
        # The token count of the loss and in-place arithmetic (no gradient): the step's remaining ops.
        x = torch.zeros(tokens, ffn, dtype=dtype)
        ops.ne(target, -100), ops.clamp(target, min=1), ops.clamp(x, max=1.0), ops.clamp(x, -1.0, 1.0)
        ops.reciprocal(x), ops.minimum(x, x), ops.mul(x, x[0], out=x)
        weight = leaf(ffn, dim)
        weight.grad = torch.zeros_like(weight)
        ops.AdamW([weight]).step()
        # Clipping the gradients: their norms, the norm of the norms, the scale.
        norms = ops.foreach_norm([weight.grad, x], dtype=torch.float32)
        ops.foreach_mul_([weight.grad, x], ops.vector_norm(ops.stack(norms)))


def distinct(specs: list[dict]) -> list[dict]:
    """The specialisations worth compiling: every one of the hand-written kernels; of the generated pointwise
    kernels (hundreds: each scalar body at each rank, arity, dtype and alignment), one per scalar body, compute
    dtype and tensor/scalar pattern, so that each body compiles in each dtype it computes in and each template
    compiles with some body, in minutes rather than an hour."""
    seen, kept = set(), []
    for spec in specs:
        name = spec["kernel"]["name"]
        if name.startswith("_pw_"):
            body = {k: v for k, v in spec["constexprs"].items() if k in ("FN", "COMPUTE")}
            key = (name.split("_o")[0], json.dumps(body, sort_keys=True))
        else:
            key = json.dumps(spec, sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(spec)
    return kept


def compile_all(path: str, archs: list[int]) -> list[str]:
    """Compile the distinct recorded specialisations for each architecture, on every core; one line per failure."""
    from concurrent.futures import ProcessPoolExecutor

    with open(path) as f:
        specs = distinct([json.loads(line) for line in f if line.strip()])
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return [line for lines in pool.map(compile_spec, specs, [archs] * len(specs)) for line in lines]


if __name__ == "__main__":
    if sys.argv[1] == "record-model-shapes":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("record with TRITON_INTERPRET=1: launches are recorded where the interpreter runs them")
        record_model_shapes(sys.argv[2])
        sys.exit(0)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile with TRITON_INTERPRET unset: the interpreter replaces @triton.jit")
    path, archs = sys.argv[1], [int(a) for a in sys.argv[2:]]
    with open(path) as f:
        count = len(distinct([json.loads(line) for line in f if line.strip()]))
    problems = compile_all(path, archs)
    for line in problems:
        print(line)
    print(f"{count} specialisations x {len(archs)} architectures: {len(problems)} failed")
    sys.exit(1 if problems else 0)
