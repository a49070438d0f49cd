"""Routing ATen ops to our kernels, as FlagGems' `enable()` / `use_gems()` do.

`enable(include, exclude)` registers the ATen overloads that `ops.aten_routes` lists (each one's function found
by its name in its family's module, `ATEN` there, or here) through `torch.library` on the CUDA dispatch key (and
on the CPU key when TRITON_INTERPRET=1, so that it runs here), below autograd: PyTorch's own derivative
formulas call the backward ops, which are routed too. `disable()` (or leaving `use_kernels()`) removes
the registrations, which restores PyTorch's kernels exactly. `calls` counts the routed calls per op.

A call our kernel does not compute is declined: its dtype (the first tensor's, and a `dtype=` asked for) is not
among those `ops.catalog` declares for the op, or its function raises `catalog.Declined`; PyTorch's own
kernel for that dispatch key, taken before ours replaced it, runs it (`declined` counts them).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import warnings

import torch

from ops import (
    activations,
    attention,
    copies,
    embeddings,
    foreach,
    indexing,
    multi_tensor,
    norms,
    pointwise_aten,
    pointwise_ops,
    reductions,
    sampling,
    scans,
    sorting,
)
from ops.aten_routes import NAMES, TABLE
from ops.blas import matmul
from ops.catalog import Declined, dtypes_of
from ops.softmaxes import softmax_backward, softmax_forward

calls: collections.Counter = collections.Counter()
declined: collections.Counter = collections.Counter()
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64,
           "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
           "bool": torch.bool}


def _gelu(self, *, approximate="none"):
    return activations.gelu_fwd(self) if approximate == "none" else activations.gelu_tanh_fwd(self)


def _gelu_backward(grad_output, self, *, approximate="none"):
    bwd = activations.gelu_bwd if approximate == "none" else activations.gelu_tanh_bwd
    return bwd(self, grad_output).to(self.dtype)


def _softmax(self, dim, half_to_float, log=False):
    return softmax_forward(self, dim % max(self.dim(), 1), log, torch.float32 if half_to_float else None)


def _softmax_backward_data(grad_output, output, dim, input_dtype, log=False):
    return softmax_backward(grad_output, output, dim % max(output.dim(), 1), log, input_dtype)


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return embeddings._forward(weight, indices)


def _embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    return embeddings._backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)


def _shares(self, *others) -> bool:
    """Whether another operand reads `self`'s memory, which a kernel writing `self` in place could overwrite
    before another program reads it."""
    ptr = self.untyped_storage().data_ptr()
    return any(isinstance(o, torch.Tensor) and o is not self and o.untyped_storage().data_ptr() == ptr
               for o in others)


def _addmm_(self, mat1, mat2, *, beta=1, alpha=1):
    if _shares(self, mat1, mat2):
        return self.copy_(matmul(mat1, mat2, self, alpha, beta))
    return matmul(mat1, mat2, self, alpha, beta, out=self)


def _floats(*tensors) -> bool:
    return all(t.dtype in multi_tensor.TL for t in tensors)


def _vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    if ord != 2 or not _floats(self) or (dtype is not None and dtype not in multi_tensor.TL):
        return reductions.vector_norm(self, ord, dim, keepdim, dtype)
    return multi_tensor.vector_norm(self, 2, dim, keepdim, dtype)


def _foreach_norm(self, ord=2, dtype=None):
    if ord != 2 or not _floats(*self) or (dtype is not None and dtype not in multi_tensor.TL):
        return [reductions.vector_norm(t, ord, None, False, dtype) for t in self]
    return multi_tensor.foreach_norm(list(self), 2, dtype)


def _foreach_mul_(self, other):
    """Clipping's scale: one launch over the contiguous float tensors, the others one by one."""
    fast = [t for t in self if t.is_contiguous() and _floats(t)]
    multi_tensor.foreach_mul_(fast, other)
    for t in self:
        if not (t.is_contiguous() and _floats(t)):
            pointwise_ops.into_self(pointwise_ops.mul, t, other)


def _stack(tensors, dim=0):
    if not _floats(*tensors):
        return torch.cat([t.unsqueeze(dim) for t in tensors], dim)
    return multi_tensor.stack(list(tensors), dim)


def _mm_out(self, mat2, *, out):
    if tuple(out.shape) != (self.shape[0], mat2.shape[1]):
        out.resize_(self.shape[0], mat2.shape[1])
    if _shares(out, self, mat2):
        return out.copy_(matmul(self, mat2))
    return matmul(self, mat2, out=out)


def _baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    product = matmul(batch1, batch2)
    if alpha != 1:
        product = pointwise_ops.mul(product, alpha)
    scaled = pointwise_ops.mul(self, beta) if beta != 1 else self
    return product if beta == 0 else pointwise_ops.add(scaled, product)


def _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    """A mixture of experts' grouped matmul: one routed matmul per group of rows (or, both operands 2-D, of
    the shared dimension: the experts' weight gradients), the groups' ends read from `offs`."""
    if bias is not None:
        raise ValueError("_grouped_mm: the routed kernel takes no bias")
    dtype = out_dtype or self.dtype
    if offs is None:
        return matmul(self, mat2).to(dtype)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if self.dim() == 2 and mat2.dim() == 3:
        out = torch.empty(self.shape[0], mat2.shape[-1], dtype=dtype, device=self.device)
        parts = [(out[s:e], self[s:e], mat2[g]) for g, (s, e) in enumerate(zip(starts, ends, strict=True))]
    elif self.dim() == 3 and mat2.dim() == 2:
        out = torch.empty(self.shape[1], mat2.shape[-1], dtype=dtype, device=self.device)
        parts = [(out[:, s:e], self[g], mat2[:, s:e]) for g, (s, e) in enumerate(zip(starts, ends, strict=True))]
    else:
        out = torch.empty(len(ends), self.shape[0], mat2.shape[-1], dtype=dtype, device=self.device)
        parts = [(out[g], self[:, s:e], mat2[s:e]) for g, (s, e) in enumerate(zip(starts, ends, strict=True))]
    for target, a, b in parts:
        if target.numel():
            if a.shape[-1]:
                pointwise_ops.OPS["copy"](matmul(a, b), out=target)
            else:  # an empty group of the shared dimension: its product is zeros
                pointwise_ops.OPS["fill"](target, 0, out=target)
    return out


# The functions of the overloads whose families (ops.aten_routes) have no module of ATen functions of their own.
_OWN = {
    "silu": lambda self: activations.silu_fwd(self),
    "silu_backward": lambda grad_output, self: activations.silu_bwd(self, grad_output).to(self.dtype),
    "gelu": _gelu,
    "gelu_backward": _gelu_backward,
    "_softmax": _softmax,
    "_softmax_backward_data": _softmax_backward_data,
    "_log_softmax": functools.partial(_softmax, log=True),
    "_log_softmax_backward_data": functools.partial(_softmax_backward_data, log=True),
    "addmm": lambda self, mat1, mat2, *, beta=1, alpha=1: matmul(mat1, mat2, self, alpha, beta),
    "addmm_": _addmm_,
    "mm": lambda self, mat2: matmul(self, mat2),
    "mm.out": _mm_out,
    "bmm": lambda self, mat2: matmul(self, mat2),
    "baddbmm": _baddbmm,
    "_grouped_mm": _grouped_mm,
    "mv": lambda self, vec: matmul(self, vec[:, None])[:, 0],
    "dot": lambda self, tensor: reductions.reduce(pointwise_ops.mul(self, tensor), None, False, "sum"),
    "embedding": _embedding,
    "embedding_dense_backward": _embedding_dense_backward,
    "_foreach_norm.Scalar": _foreach_norm,
    "stack": _stack,
    "linalg_vector_norm": _vector_norm,
    "_foreach_mul_.Tensor": _foreach_mul_,
}
_FUNCTIONS = {**_OWN, **attention.ATEN, **pointwise_aten.ATEN, **copies.ATEN, **reductions.ATEN, **scans.ATEN,
              **sorting.ATEN, **norms.ATEN, **indexing.ATEN, **sampling.ATEN,
              **foreach.ATEN}
# Each routed overload's function, in the table's order.
OPS = {aten: _FUNCTIONS[aten] for _, aten in TABLE}
if set(_FUNCTIONS) != set(OPS):
    raise LookupError(f"functions for ATen overloads that ops.aten_routes does not route: "
                      f"{', '.join(sorted(set(_FUNCTIONS) - set(OPS)))}")

_library: torch.library.Library | None = None
_routed: list[str] = []


def _call_dtypes(args, kwargs) -> list[torch.dtype]:
    """The dtypes a call computes in: its first tensor's (or its first list's first tensor's) and a `dtype=`."""
    found = [kwargs["dtype"]] if kwargs.get("dtype") is not None else []
    for a in args:
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            a = a[0]
        if isinstance(a, torch.Tensor):
            return [a.dtype, *found]
    return found


def _number_as_tensor(value, like: torch.Tensor | None) -> torch.Tensor:
    """A Python number where the schema wants a tensor, as PyTorch's wrapped number promotes: the number's
    own widest dtype beside a tensor of its kind (so its value keeps its precision), else its default dtype."""
    kind = (bool, int, float, complex)
    rank = next(i for i, t in enumerate(kind) if isinstance(value, t))
    default = (torch.bool, torch.int64, torch.get_default_dtype(), torch.complex64)[rank]
    if like is None:
        return torch.tensor(value, dtype=default)
    like_rank = 3 if like.is_complex() else 2 if like.is_floating_point() else 0 if like.dtype == torch.bool else 1
    widest = (torch.bool, torch.int64, torch.float64, torch.complex128)[rank]
    dtype = default if rank > like_rank else like.dtype if rank < like_rank or like.dim() == 0 else widest
    return torch.tensor(value, dtype=dtype, device=like.device)


def _boxed_args(schema, args) -> list:
    """`args` as PyTorch's kernel takes them boxed: a number that the Python kernel was handed for a tensor
    argument (a wrapped number) made a tensor again."""
    like = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return [_number_as_tensor(a, like) if isinstance(a, (bool, int, float, complex)) and
            isinstance(arg.type, torch.TensorType) else a for a, arg in zip(args, schema.arguments, strict=False)]


def _kernel(name, fn, key: str):
    """`fn` as the kernel of ATen's `name` on dispatch key `key`, counted, declining to PyTorch's kernel."""
    dispatch_key = getattr(torch._C.DispatchKey, key)
    has = torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"aten::{name}", key)
    # None: this build of PyTorch has no kernel there (CUDA's in a CPU build), so no call can reach it.
    pytorch = torch._C._dispatch_get_computed_kernel_for_dispatch_key(f"aten::{name}", dispatch_key) if has else None
    keyset = torch._C.DispatchKeySet(dispatch_key)
    takes = {_DTYPES[d] for d in dtypes_of(name)}
    op, _, overload = name.partition(".")
    schema = getattr(getattr(torch.ops.aten, op), overload or "default")._schema
    # PyTorch's kernels call others with a wrapped number as `self` (`ne(x, 0)` casts its 0): PyTorch's work.
    numeric_self = bool(schema.arguments) and isinstance(schema.arguments[0].type, torch.TensorType)

    def impl(*args, **kwargs):
        wrapped = numeric_self and bool(args) and isinstance(args[0], (bool, int, float, complex))
        if not wrapped and all(d in takes for d in _call_dtypes(args, kwargs)):
            calls[name] += 1
            try:
                return fn(*args, **kwargs)
            except Declined:
                calls[name] -= 1
        declined[name] += 1
        return pytorch.call_boxed(keyset, *_boxed_args(schema, args), **kwargs)

    return impl


def _aten_names(names: list[str]) -> list[str]:
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise ValueError(f"not routable: {', '.join(unknown)}; the ops are {', '.join(sorted(NAMES))}")
    return [aten for name in names for aten in NAMES[name]]


def enable(include: list[str] | None = None, exclude: list[str] | None = None) -> None:
    """Route the ops named in `include` (default: all), less `exclude`, to our kernels. A name is our op's
    (`softmax`, `log_softmax`, `silu`, `gelu`, `addmm`, `mm`, `bmm`, `embedding`, `add`, `sub`, `mul`, `div`,
    `ne`, `clamp`, `reciprocal`, `sum`, `foreach_norm`, `stack`, `vector_norm`, `foreach_mul_`: forward and
    backward, in-place and out= forms included) or an ATen op's (`_softmax`, `add.Tensor`)."""
    global _library, _routed
    chosen = _aten_names(list(include)) if include else list(OPS)
    excluded = set(_aten_names(list(exclude or [])))
    disable()
    names = list(dict.fromkeys(n for n in chosen if n not in excluded))
    keys = ["CUDA"] + (["CPU"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    _library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "overriding a previously registered kernel" is the point
        for name in names:
            for key in keys:
                _library.impl(name, _kernel(name, OPS[name], key), key)
    _routed = names


def disable() -> None:
    """Give every routed op back to PyTorch."""
    global _library, _routed
    if _library is not None:
        _library._destroy()
    _library, _routed = None, []


@contextlib.contextmanager
def use_kernels(include: list[str] | None = None, exclude: list[str] | None = None):
    """Route ATen ops to our kernels inside the block; restore what was routed before on leaving."""
    before = list(_routed)
    enable(include, exclude)
    try:
        yield
    finally:
        disable()
        if before:
            enable(before)


def registered() -> list[str]:
    """The ATen ops currently routed to our kernels."""
    return list(_routed)
