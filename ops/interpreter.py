"""Running the kernels under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors): two corrections, and
launches that dispatch no ATen op of their own (their host copies run in PyTorch's `copy_`).

The interpreter keeps bf16 values as their raw 16 bits (numpy has no bf16), and so
- its `tl.dot` multiplies those bits as integers. A GPU multiplies bf16 tiles exactly into an fp32
  accumulator, so widening both tiles to fp32 first gives the GPU's result;
- its casts to bf16 cut fp32 values toward zero, and cast integers to bf16 (and bf16 to integers) as raw
  bits. A GPU's cast to bf16 rounds to nearest even, as PyTorch's does (Triton's default for a narrowing
  float cast, and the `rtne` a kernel may name): every cast to or from bf16 here goes through fp32 and
  PyTorch's rounding, so a bf16 result computed here is the GPU's.

Each interpreted launch copies its tensor arguments to host storages and back with ATen ops (`copy_`,
`set_`, `empty`); a compiled launch dispatches none. They run with the Python dispatch modes set aside, so a
`TorchDispatchMode` that traces a step under the interpreter sees the ATen calls a GPU would dispatch.
Nothing here runs when the kernels are compiled.
"""

from __future__ import annotations

import os
import threading

_state = threading.local()


def launching() -> bool:
    """Whether an interpreted launch is running on this thread: its own host copies (`copy_`) must be
    PyTorch's, not a routed op that would launch a kernel of its own inside it."""
    return getattr(_state, "depth", 0) > 0


def install() -> None:
    """Make the interpreter's `tl.dot` widen bf16 tiles, its bf16 casts round to nearest even, and its
    launches run without the Python dispatch modes (once; only when TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    dot = InterpreterBuilder.create_dot
    if getattr(dot, "widens_bf16", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot.widens_bf16 = True
    InterpreterBuilder.create_dot = create_dot
    _bf16_casts_round_to_nearest_even()
    _launch_without_modes()


def _to_bf16_bits(values):
    """numpy values (any real dtype) as bf16's raw bits, through fp32, rounded to nearest even as PyTorch's
    `c10::BFloat16` rounds (a NaN stays a quiet NaN). numpy alone: nothing dispatched inside a launch."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(values, dtype=np.float32)), np.uint16(0x7FC0), rounded)


def _bf16_casts_round_to_nearest_even() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle, _get_np_dtype

    cast, to_fp = InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp

    def cast_impl(self, src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == dst_ty or tl.bfloat16 not in (src_ty, dst_ty):
            return cast(self, src, dst_type)
        if src_ty == tl.bfloat16:  # exact: the bits are fp32's top half
            wide = (src.data.astype(np.uint32) << 16).view(np.float32)
            return TensorHandle(wide.astype(_get_np_dtype(dst_type)), dst_ty)
        return TensorHandle(_to_bf16_bits(src.data), dst_ty)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        from triton._C.libtriton import ir

        if dst_type.scalar == tl.bfloat16 and rounding_mode in (None, ir.ROUNDING_MODE.RTNE):
            return cast_impl(self, src, dst_type)
        return to_fp(self, src, dst_type, rounding_mode)

    InterpreterBuilder.cast_impl = cast_impl  # the create_*_to_* casts call it
    InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def _launch_without_modes() -> None:
    import torch.utils._python_dispatch as python_dispatch
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "without_modes", False):
        return

    def launch(self, *args, **kwargs):
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            with python_dispatch._disable_current_modes():
                return run(self, *args, **kwargs)
        finally:
            _state.depth -= 1

    launch.without_modes = True
    InterpretedFunction.run = launch
