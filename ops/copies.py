"""The copy shims: `Tensor.copy_`, `Tensor.to` (ATen's `_to_copy`) and `clone` routed to the generated copy op
(`ops.pointwise_ops`' `copy`, which casts as it copies) where a copy stays on one device between real dtypes;
a transfer between devices, a complex tensor, another layout, and the interpreter's own host copies are
PyTorch's. `ATEN` holds their functions (`ops.aten_routes`' "copies" family).
"""

from __future__ import annotations

import torch

from ops import interpreter
from ops.pointwise_ops import OPS


def _same_device_real(*tensors) -> bool:
    return all(not t.is_complex() and t.layout == torch.strided for t in tensors) and len(
        {t.device for t in tensors}) == 1


_EXPLICIT = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _copy_(self, src, non_blocking=False):
    """`Tensor.copy_`: ours on one device between real dtypes; across devices PyTorch's own."""
    if not _same_device_real(self, src) or interpreter.launching():
        return torch.ops.aten.copy_.default.redispatch(_EXPLICIT, self, src, non_blocking)
    if src.dtype != self.dtype and src.is_complex():
        raise RuntimeError("copy_: a complex source into a real tensor drops the imaginary part")
    return OPS["copy"](src.expand(self.shape), out=self) if self.numel() else self


def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    """`Tensor.to` (a cast or a copy): ours on the same device; a transfer is PyTorch's own."""
    same = device is None or torch.device(device) == self.device
    if not same or pin_memory or (layout not in (None, torch.strided)) or self.is_complex() or (
            dtype is not None and dtype.is_complex):
        return torch.ops.aten._to_copy.default.redispatch(
            _EXPLICIT, self, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
            non_blocking=non_blocking, memory_format=memory_format)
    out = torch.empty_like(self, dtype=dtype or self.dtype, memory_format=memory_format or torch.preserve_format)
    return OPS["copy"](self, out=out) if out.numel() else out


def _clone(self, *, memory_format=None):
    return _to_copy(self, memory_format=memory_format)


ATEN = {"copy_": _copy_, "_to_copy": _to_copy, "clone": _clone}
