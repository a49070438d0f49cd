"""The `kernels` section: PyTorch's kernels, or which Triton kernels of ops/ the run uses
(`kernels=torch|triton`): the model's five fused functions (`TRITON_OPS`) and, with `kernels.aten=true`,
the ATen ops `ops.enable()` routes during the training step and eval (`ATEN_OPS`, or one of their ATen
overloads). No torch here: the names are read from ops' own table, `ops.aten_routes` (plain data; `import ops`
loads no torch)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from omegaconf import MISSING

from ops.aten_routes import ATEN_OPS, NAMES
from trainer.config.checks import one_of, read_by, require

KERNELS = ("torch", "triton")
# The model functions `kernels=triton` can route to ops/ (trainer/models/kernels.py applies them).
TRITON_OPS = ("rms_norm", "rotary_embedding", "scaled_dot_product_attention", "silu_and_mul",
              "fused_linear_cross_entropy")


@dataclass
class KernelsConfig:
    name: str = MISSING  # the option chosen: torch (PyTorch's own ops) or triton (ops/' kernels)
    # triton: which of TRITON_OPS and ATEN_OPS to use (null: all), and which to leave to PyTorch.
    include: list[str] | None = read_by("triton", default=None)
    exclude: list[str] = read_by("triton", default_factory=list)  # of include, those left to PyTorch
    # triton: route ATen ops to ops/ during the step and eval (ops.enable()); false keeps only TRITON_OPS.
    aten: bool = read_by("triton", default=True)

    def check(self) -> None:
        one_of("kernels.name", self.name, KERNELS)
        for key in ("include", "exclude"):
            names = list(getattr(self, key) or [])
            unknown = [op for op in names if op not in TRITON_OPS and op not in NAMES]
            require(not unknown, f"kernels.{key}", names,
                    f"{', '.join(unknown)} unknown: the model's ops are {', '.join(TRITON_OPS)}; the ATen ops "
                    f"(kernels.aten=true) are the {len(ATEN_OPS)} that `python -m ops list` prints (add, mm, "
                    f"softmax, ...), or an ATen overload of one (add.Tensor, mm.out, ...)")
        included_aten = [op for op in self.include or [] if op in NAMES]
        require(self.aten or not included_aten, "kernels.include", list(self.include or []),
                f"{', '.join(included_aten)}: ATen ops, routed only with kernels.aten=true")
        # Found, not imported: Triton fixes at import whether its own functions are interpreted (TRITON_INTERPRET),
        # and the driver loads no kernel library.
        require(self.name != "triton" or importlib.util.find_spec("triton") is not None, "kernels", "triton",
                "needs the triton package: pip install triton")
