"""trainjob's Triton operator library for training: each op runs forward and backward in Triton kernels,
computes in fp32 whatever its input dtype (fp32, fp16, bf16), and takes tensors of any leading shape.

Usable on its own (it never imports `trainer` or `launchers`). On a machine without a GPU, the kernels
run under Triton's interpreter when TRITON_INTERPRET=1 is set (slow; for tests).
"""

from ops.activations import gelu, gelu_and_mul, silu, silu_and_mul
from ops.losses import cross_entropy, fused_linear_cross_entropy
from ops.norms import layer_norm, rms_norm
from ops.pointwise import pointwise
from ops.rope import rotary_embedding

__all__ = ["cross_entropy", "fused_linear_cross_entropy", "gelu", "gelu_and_mul", "layer_norm", "pointwise",
           "rms_norm", "rotary_embedding", "silu", "silu_and_mul"]
