"""What `ops.aten` routes, as a table read from `ops.aten_routes` (no torch): per public ATen op (its name
without overload or trailing `_`), the overloads routed, whether a backward is among them, and the dtypes its
kernels take."""

from __future__ import annotations

import dataclasses

from ops.aten_routes import TABLE

FLOATS = "fp32,bf16,fp16,fp64"
ALL = FLOATS + ",int,bool"
# Forward ops whose kernels take only floating dtypes (the rest: integers and bools too). Every backward op
# is floating only: it computes a gradient, and autograd makes gradients of floating tensors alone.
_FLOAT_ONLY = {"softmax", "log_softmax", "_softmax", "_log_softmax", "gelu", "silu", "mm", "addmm", "bmm", "baddbmm",
               "mv", "native_layer_norm", "native_group_norm", "_fused_rms_norm", "mean", "var", "std", "var_mean",
               "std_mean", "_scaled_dot_product_flash_attention_for_cpu", "_grouped_mm", "histc", "log_sigmoid_forward",
               "logsumexp", "norm", "linalg_vector_norm", "uniform_", "normal_", "multinomial", "native_dropout",
               "mse_loss", "nll_loss_forward", "_foreach_norm"}


@dataclasses.dataclass
class Row:
    op: str
    overloads: list[str]
    routes: str
    dtypes: str


def public_name(aten: str) -> str:
    """`add_.Tensor` -> `add`; `sigmoid_backward` stays itself (a backward is an op of its own)."""
    name = aten.split(".")[0]
    return name[:-1] if name.endswith("_") and not name.startswith("_foreach") and name[:-1] else name


def rows() -> list[Row]:
    by_op: dict[str, list[str]] = {}
    for _, aten in TABLE:
        by_op.setdefault(public_name(aten), []).append(aten)
    out = []
    for op, overloads in sorted(by_op.items()):
        backward = any("backward" in a for a in overloads)
        routes = "backward" if "backward" in op else ("fwd" if not backward else "fwd+bwd")
        floating = backward or op in _FLOAT_ONLY or any(public_name(a) in _FLOAT_ONLY for a in overloads)
        dtypes = FLOATS if floating else ALL
        out.append(Row(op, overloads, routes, dtypes))
    return out


def summary() -> str:
    table = rows()
    forward = [r for r in table if r.routes != "backward"]
    return (f"{len(table)} public ATen ops routed ({len(forward)} forward, {len(table) - len(forward)} backward), "
            f"{len(TABLE)} overloads")
