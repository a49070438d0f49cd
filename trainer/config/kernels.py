"""The `kernels` section: PyTorch's kernels, or which Triton kernels of ops/ the model uses
(`kernels=torch|triton`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from trainer.config.checks import one_of, require

KERNELS = ("torch", "triton")
# The model functions `kernels=triton` can route to ops/ (trainer/kernels.py applies them).
TRITON_OPS = ("rms_norm", "rotary_embedding", "scaled_dot_product_attention", "silu_and_mul",
              "fused_linear_cross_entropy")


@dataclass
class KernelsConfig:
    name: str = MISSING
    # triton: which of TRITON_OPS to use (null: all), and which to leave to PyTorch.
    include: list[str] | None = None
    exclude: list[str] = field(default_factory=list)

    def check(self) -> None:
        one_of("kernels.name", self.name, KERNELS)
        for key in ("include", "exclude"):
            for op in getattr(self, key) or []:
                require(op in TRITON_OPS, f"kernels.{key}", list(getattr(self, key)),
                        f"ops are {', '.join(TRITON_OPS)}")
        if self.name == "triton":
            try:
                import triton  # noqa: F401
            except ImportError:
                require(False, "kernels", "triton", "needs the triton package: pip install triton")
