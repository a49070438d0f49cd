"""Routing ATen ops to our kernels, as FlagGems' `enable()` / `use_gems()` do.

`enable(include, exclude)` registers the ops below through `torch.library` on the CUDA dispatch key (and
on the CPU key when TRITON_INTERPRET=1, so that it runs here), below autograd: PyTorch's own derivative
formulas call the backward ops, which are routed too. `disable()` (or leaving `use_kernels()`) removes
the registrations, which restores PyTorch's kernels exactly. `calls` counts the routed calls per op.
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings

import torch

from ops import activations, blas, softmax

calls: collections.Counter = collections.Counter()


def _gelu_fwd(self, *, approximate="none"):
    return activations.gelu_fwd(self) if approximate == "none" else activations.gelu_tanh_fwd(self)


def _gelu_bwd(grad_output, self, *, approximate="none"):
    bwd = activations.gelu_bwd if approximate == "none" else activations.gelu_tanh_bwd
    return bwd(self, grad_output).to(self.dtype)


def _softmax(log: bool):
    def fwd(self, dim, half_to_float):
        return softmax.softmax_forward(self, dim % max(self.dim(), 1), log,
                                       torch.float32 if half_to_float else None)

    def bwd(grad_output, output, dim, input_dtype):
        return softmax.softmax_backward(grad_output, output, dim % max(output.dim(), 1), log, input_dtype)

    return fwd, bwd


_SOFTMAX, _SOFTMAX_BWD = _softmax(False)
_LOG_SOFTMAX, _LOG_SOFTMAX_BWD = _softmax(True)

OPS = {
    "silu": lambda self: activations.silu_fwd(self),
    "silu_backward": lambda grad_output, self: activations.silu_bwd(self, grad_output).to(self.dtype),
    "gelu": _gelu_fwd,
    "gelu_backward": _gelu_bwd,
    "_softmax": _SOFTMAX,
    "_softmax_backward_data": _SOFTMAX_BWD,
    "_log_softmax": _LOG_SOFTMAX,
    "_log_softmax_backward_data": _LOG_SOFTMAX_BWD,
    "addmm": lambda self, mat1, mat2, *, beta=1, alpha=1: blas.matmul(mat1, mat2, self, alpha, beta),
}

_library: torch.library.Library | None = None
_routed: list[str] = []


def _counted(name, fn):
    def impl(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return impl


def enable(include: list[str] | None = None, exclude: list[str] | None = None) -> None:
    """Route the ATen ops named in `include` (default: all of `OPS`), less `exclude`, to our kernels."""
    global _library, _routed
    unknown = sorted(set(include or []) | set(exclude or []) - set(OPS))
    if unknown:
        raise ValueError(f"not routable: {', '.join(unknown)}; the ops are {', '.join(sorted(OPS))}")
    disable()
    names = [n for n in (include or OPS) if n not in set(exclude or [])]
    keys = ["CUDA"] + (["CPU"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    _library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "overriding a previously registered kernel" is the point
        for name in names:
            for key in keys:
                _library.impl(name, _counted(name, OPS[name]), key)
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
