"""trainjob's Triton operator library for training: each op runs forward and backward in Triton kernels,
computes in fp32 whatever its input dtype (fp32, fp16, bf16), and takes tensors of any leading shape.

Usable on its own (it never imports `trainer` or `launchers`; its face is `trainjob.lazy`'s). On a machine
without a GPU, the kernels run under Triton's interpreter when TRITON_INTERPRET=1 is set (slow; for tests).

Its names load on first use (as `launchers`' do), so that `import ops` loads neither torch nor triton: the
driver reads the table of routed ATen ops (`ops.aten_routes`, plain data) without them.
"""

from __future__ import annotations

from trainjob import lazy

_HOMES = {
    **dict.fromkeys(("gelu", "gelu_and_mul", "silu", "silu_and_mul"), "ops.activations"),
    **dict.fromkeys(("disable", "enable", "registered", "use_kernels"), "ops.aten"),
    "scaled_dot_product_attention": "ops.attention",
    **dict.fromkeys(("addmm", "bmm", "mm"), "ops.blas"),
    "embedding": "ops.embeddings",
    **dict.fromkeys(("cross_entropy", "fused_linear_cross_entropy"), "ops.losses"),
    **dict.fromkeys(("foreach_mul_", "foreach_norm", "stack", "vector_norm"), "ops.multi_tensor"),
    **dict.fromkeys(("layer_norm", "rms_norm"), "ops.norms"),
    **dict.fromkeys(("AdamW", "adamw"), "ops.optim"),
    "pointwise": "ops.pointwise_codegen",
    **dict.fromkeys(("add", "clamp", "div", "maximum", "minimum", "mul", "ne", "reciprocal", "sub", "where"),
                    "ops.pointwise_ops"),
    "sum": "ops.reductions",
    "rotary_embedding": "ops.rope",
    **dict.fromkeys(("log_softmax", "softmax"), "ops.softmaxes"),
}

__all__ = sorted(_HOMES)

__getattr__ = lazy.names(__name__, _HOMES)
