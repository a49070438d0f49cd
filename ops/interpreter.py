"""Running the kernels under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors): one correction, and
launches that dispatch no ATen op of their own (their host copies run in PyTorch's `copy_`).

The interpreter keeps bf16 values as their raw 16 bits (numpy has no bf16) and its `tl.dot` multiplies
those bits as integers. A GPU multiplies bf16 tiles exactly into an fp32 accumulator, so widening both
tiles to fp32 first gives the GPU's result.

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
    """Make the interpreter's `tl.dot` widen bf16 tiles and its launches run without the Python dispatch
    modes (once; only when TRITON_INTERPRET=1)."""
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
    _launch_without_modes()


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
