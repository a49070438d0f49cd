"""trainjob's Triton operator library for training: each op runs forward and backward in Triton kernels,
computes in fp32 whatever its input dtype (fp32, fp16, bf16), and takes tensors of any leading shape.

Usable on its own (it never imports `trainer` or `launchers`). On a machine without a GPU, the kernels
run under Triton's interpreter when TRITON_INTERPRET=1 is set (slow; for tests).
"""

from ops import interpreter
from ops.activations import gelu, gelu_and_mul, silu, silu_and_mul
from ops.aten import disable, enable, registered, use_kernels
from ops.attention import scaled_dot_product_attention
from ops.blas import addmm, bmm, mm
from ops.embedding import embedding
from ops.losses import cross_entropy, fused_linear_cross_entropy
from ops.multi_tensor import foreach_mul_, foreach_norm, stack, vector_norm
from ops.norms import layer_norm, rms_norm
from ops.optim import AdamW, adamw
from ops.pointwise import pointwise
from ops.pointwise_ops import add, clamp, div, maximum, minimum, mul, ne, reciprocal, sub, where
from ops.reductions import sum
from ops.rope import rotary_embedding
from ops.softmax import log_softmax, softmax

interpreter.install()

__all__ = [
           "AdamW",
           "adamw",
           "add",
           "addmm",
           "bmm",
           "clamp",
           "cross_entropy",
           "disable",
           "div",
           "embedding",
           "enable",
           "foreach_mul_",
           "foreach_norm",
           "fused_linear_cross_entropy",
           "gelu",
           "gelu_and_mul",
           "layer_norm",
           "log_softmax",
           "maximum",
           "minimum",
           "mm",
           "mul",
           "ne",
           "pointwise",
           "reciprocal",
           "registered",
           "rms_norm",
           "rotary_embedding",
           "scaled_dot_product_attention",
           "silu",
           "silu_and_mul",
           "softmax",
           "stack",
           "sub",
           "sum",
           "use_kernels",
           "vector_norm",
           "where",
]
