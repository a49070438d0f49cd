"""Running the kernels under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors): one correction.

The interpreter keeps bf16 values as their raw 16 bits (numpy has no bf16) and its `tl.dot` multiplies
those bits as integers. A GPU multiplies bf16 tiles exactly into an fp32 accumulator, so widening both
tiles to fp32 first gives the GPU's result. Nothing here runs when the kernels are compiled.
"""

from __future__ import annotations

import os


def install() -> None:
    """Make the interpreter's `tl.dot` widen bf16 tiles (once; only when TRITON_INTERPRET=1)."""
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
