"""`@pointwise`: a scalar `@triton.jit` function becomes a whole elementwise op, as FlagGems'
`pointwise_dynamic` does.

The op's arity is the function's: each argument is a tensor (broadcast against the others, read through
its strides, never copied) or a Python number (passed to the kernel as a scalar). Dtypes are promoted by
torch's rules (`promote="float"`: integer results become the default float dtype, as for activations;
`promote="bool"`: a comparison, computed in the operands' promoted dtype, gives bool); the function
receives fp32 values (int64 ones when the operands are integers: exact) and returns one value, or a
tuple of `outputs` values, each written to a new tensor of the promoted dtype, or, for a one-output op
called with `out=`, into that tensor (contiguous, of the broadcast shape: how in-place ops run).

One kernel is generated per (which arguments are tensors, number of outputs, rank after merging the
dimensions that every operand walks contiguously), so a contiguous op runs one flat loop and a broadcast
one a rank-2 or rank-3 index. Generated kernels live in this module under their names
(`_pw_<T|S per argument>_o<outputs>_r<rank>`), and `getattr` on the module makes any of them.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import re

import torch
import triton
import triton.language as tl
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ops.settings import POINTWISE_BLOCK, warps

# torch's own n-ary promotion rules, as its reference ops use them.
KIND = {"default": ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT, "float": ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT,
        "bool": ELEMENTWISE_TYPE_PROMOTION_KIND.ALWAYS_BOOL}
_NAME = re.compile(r"_pw_([TS]+)_o([1-9])_r([1-9][0-9]?)$")
_INT32_LIMIT = 2**31


def _source(kinds: str, outputs: int, rank: int) -> str:
    """The Triton source of the kernel named `_pw_{kinds}_o{outputs}_r{rank}`."""
    tensors = [i for i, k in enumerate(kinds) if k == "T"]
    params = [f"in{i}" if k == "T" else f"s{i}" for i, k in enumerate(kinds)]
    params += [f"out{j}" for j in range(outputs)] + ["n"] + [f"size{d}" for d in range(rank)]
    params += [f"stride{i}_{d}" for i in tensors for d in range(rank)]
    params += [f"ostride{j}_{d}" for j in range(outputs) for d in range(rank)]
    params += ["FN: tl.constexpr", "COMPUTE: tl.constexpr", "WIDE: tl.constexpr", "BLOCK: tl.constexpr"]
    lines = [f"def _pw_{kinds}_o{outputs}_r{rank}({', '.join(params)}):",
             "    if WIDE:",
             "        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)",
             "    else:",
             "        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
             "    mask = offs < n"]
    # Unravel the flat output index into one index per dimension, last dimension fastest.
    rest = "offs"
    for d in reversed(range(rank)):
        if d == 0:
            lines.append(f"    i0 = {rest}")
        else:
            lines.append(f"    i{d} = {rest} % size{d}")
            lines.append(f"    rest{d} = {rest} // size{d}")
            rest = f"rest{d}"
    args = []
    for i, k in enumerate(kinds):
        if k == "T":
            address = " + ".join(f"i{d} * stride{i}_{d}" for d in range(rank))
            lines.append(f"    v{i} = tl.load(in{i} + {address}, mask=mask, other=0).to(COMPUTE)")
        else:
            lines.append(f"    v{i} = tl.zeros([BLOCK], dtype=COMPUTE) + tl.cast(s{i}, COMPUTE)")
        args.append(f"v{i}")
    results = ", ".join(f"r{j}" for j in range(outputs))
    lines.append(f"    {results} = FN({', '.join(args)})")
    for j in range(outputs):
        address = " + ".join(f"i{d} * ostride{j}_{d}" for d in range(rank))
        # A test's bool result reaches a float output through fp32 (the interpreter cannot cast int1 to bf16).
        lines.append(f"    r{j} = r{j}.to(tl.float32) if r{j}.dtype == tl.int1 else r{j}")
        lines.append(f"    tl.store(out{j} + {address}, r{j}.to(out{j}.dtype.element_ty), mask=mask)")
    return "\n".join(lines) + "\n"


@functools.cache
def _kernel(name: str):
    match = _NAME.match(name)
    if match is None:
        raise AttributeError(name)
    kinds, outputs, rank = match.group(1), int(match.group(2)), int(match.group(3))
    return _jit(name, _source(kinds, outputs, rank), {"tl": tl, "__name__": __name__})


def _jit(name: str, source: str, namespace: dict):
    """The function `name` that `source` defines, run in `namespace`, made a `@triton.jit` function."""
    # Triton reads a function's source through `inspect`: give the generated text a file name of its own.
    filename = f"<{namespace['__name__']} {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    fn = namespace[name]
    fn.__module__ = namespace["__name__"]
    fn.__qualname__ = name
    return triton.jit(fn)


def expression_bodies(namespace: dict, expressions: dict[str, str]) -> None:
    """Scalar bodies of one expression each: `{"_hypot(x, y)": "tl.sqrt(x * x + y * y)"}` puts `_hypot`, a
    `@triton.jit` function returning that expression, in `namespace` (a module's globals, so that an expression
    calls the module's other bodies and its `tl`)."""
    for signature, expression in expressions.items():
        name = signature.partition("(")[0]
        namespace[name] = _jit(name, f"def {signature}:\n    return {expression}\n", namespace)


def __getattr__(name: str):
    """Generated kernels, by name (how a recorded launch finds its kernel again)."""
    if name.startswith("_pw_"):
        return _kernel(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _merge(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dimensions and merge neighbours that every operand walks as one (TensorIterator's
    coalescing); `strides` holds the outputs' too."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    sizes = [shape[d] for d in dims]
    merged = [[s[d] for d in dims] for s in strides]
    d = len(sizes) - 1
    while d > 0:
        if all(st[d - 1] == st[d] * sizes[d] for st in merged):
            sizes[d - 1] *= sizes[d]
            del sizes[d]
            for st in merged:
                st[d - 1] = st[d]
                del st[d]
        d -= 1
    if not sizes:
        return [1], [[0] for _ in strides]
    return sizes, merged


def _compute(dtype: torch.dtype):
    """Half and single precision operands are computed in fp32, double in fp64; integer and bool ones
    exactly, in int64."""
    if dtype == torch.float64:
        return tl.float64
    return tl.float32 if dtype.is_floating_point else tl.int64


def _check_out(out: torch.Tensor, shape: torch.Size, name: str) -> None:
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: out {tuple(out.shape)} must have the broadcast shape {tuple(shape)}")
    if out.numel() and any(st == 0 and size > 1 for st, size in zip(out.stride(), out.shape, strict=True)):
        raise ValueError(f"{name}: out {tuple(out.shape)} is an expanded view (stride 0): its elements overlap")


def _apart(out: torch.Tensor | None, tensors: list) -> list:
    """The operands, each copied first where it reads `out`'s memory through another layout (a kernel
    writing `out` could overwrite an element another program has still to read)."""
    if out is None:
        return tensors
    ptr = out.untyped_storage().data_ptr()
    return [t.clone() if (t.untyped_storage().data_ptr() == ptr and t.numel() > 1
                          and (t.data_ptr(), t.stride(), t.shape) != (out.data_ptr(), out.stride(), out.shape))
            else t for t in tensors]


def _launch(fn, args, compute: torch.dtype, dtype: torch.dtype, outputs: int, out: torch.Tensor | None = None):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise TypeError(f"{fn.__name__} needs at least one tensor argument")
    device = next((t.device for t in tensors if t.dim() > 0), tensors[0].device)
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    if out is not None:
        _check_out(out, shape, fn.__name__.lstrip("_"))
    outs = [out] if out is not None else [torch.empty(shape, dtype=dtype, device=device) for _ in range(outputs)]
    n = outs[0].numel()
    if n:
        operands = [t if t.device == device else t.to(device) for t in _apart(out, tensors)]
        operands = [t.expand(shape) for t in operands]
        sizes, strides = _merge(tuple(shape), [tuple(t.stride()) for t in [*operands, *outs]])
        reach = max(sum((size - 1) * st for size, st in zip(sizes, s, strict=True)) for s in strides)
        kinds = "".join("T" if isinstance(a, torch.Tensor) else "S" for a in args)
        kernel = _kernel(f"_pw_{kinds}_o{outputs}_r{len(sizes)}")
        it = iter(operands)
        values = [next(it) if isinstance(a, torch.Tensor) else a for a in args]
        flat_strides = [st for s in strides for st in s]
        kernel[(triton.cdiv(n, POINTWISE_BLOCK),)](
            *values, *outs, n, *sizes, *flat_strides, FN=fn, COMPUTE=_compute(compute),
            WIDE=max(n, reach + 1) + POINTWISE_BLOCK > _INT32_LIMIT, BLOCK=POINTWISE_BLOCK,
            num_warps=warps(POINTWISE_BLOCK))
    return outs[0] if outputs == 1 else tuple(outs)


def _launch_flat(fn, args, outputs: int, out: torch.Tensor | None = None):
    """Same-shape, same-dtype, contiguous float tensors: one flat loop."""
    first = args[0]
    outs = [out] if out is not None else [torch.empty_like(first) for _ in range(outputs)]
    n = first.numel()
    if n:
        kernel = _kernel(f"_pw_{'T' * len(args)}_o{outputs}_r1")
        kernel[(triton.cdiv(n, POINTWISE_BLOCK),)](*args, *outs, n, n, *([1] * (len(args) + outputs)), FN=fn,
                                                    COMPUTE=tl.float32, WIDE=n + POINTWISE_BLOCK > _INT32_LIMIT,
                                                    BLOCK=POINTWISE_BLOCK,
                                                    num_warps=warps(POINTWISE_BLOCK))
    return outs[0] if outputs == 1 else tuple(outs)


def pointwise(arity: int | None = None, promote: str = "default", outputs: int = 1):
    """Decorate a scalar `@triton.jit` function into an elementwise op. `arity`, when given, must equal
    the function's number of arguments; `outputs` is how many values it returns."""
    if promote not in KIND:
        raise ValueError(f"promote={promote!r}: use 'default', 'float' or 'bool'")
    if not 1 <= outputs <= 9:
        raise ValueError(f"outputs={outputs}: a pointwise op returns 1 to 9 tensors")

    def wrap(fn):
        names = list(inspect.signature(fn.fn if hasattr(fn, "fn") else fn).parameters)
        if arity is not None and arity != len(names):
            raise ValueError(f"{fn.__name__} takes {len(names)} arguments ({', '.join(names)}), not arity={arity}")

        @functools.wraps(fn)
        def op(*args, out: torch.Tensor | None = None):
            if len(args) != len(names):
                raise TypeError(f"{fn.__name__} takes {len(names)} tensors or numbers ({', '.join(names)}), "
                                f"got {len(args)}")
            if out is not None and outputs != 1:
                raise ValueError(f"{fn.__name__} returns {outputs} tensors: out= takes one-output ops only")
            first = args[0]
            if (promote != "bool" and isinstance(first, torch.Tensor) and first.is_floating_point()
                    and first.is_contiguous() and (out is None or (out.dtype == first.dtype and out.is_contiguous()
                                                                   and out.shape == first.shape))
                    and all(isinstance(a, torch.Tensor) and a.shape == first.shape and a.dtype == first.dtype
                            and a.device == first.device and a.is_contiguous() for a in args)):
                # The common case (an activation of a layer's output), without promotion or merging:
                # Python time per call is what small models pay.
                return _launch_flat(fn, args, outputs, out)
            compute, dtype = elementwise_dtypes(*args, type_promotion_kind=KIND[promote])
            return _launch(fn, args, compute, out.dtype if out is not None else dtype, outputs, out)

        return op

    return wrap
