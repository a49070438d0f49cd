"""What `ops.aten` routes, as a table read from `ops.aten_routes` (no torch): per public ATen op (its name
without overload or trailing `_`), the overloads routed, whether a backward is among them, and the dtypes its
kernels compute themselves.

A call outside them is declined: `ops.aten` hands it to PyTorch's own kernel (a call in another dtype, or
one whose function raises `Declined` for an argument its kernel does not take), so routing never makes a call
fail or changes its result. fp64 is PyTorch's (the kernels compute in fp32) but where values are moved, not computed."""

from __future__ import annotations

import dataclasses

from ops.aten_routes import TABLE

FLOATS = "fp32,bf16,fp16"
ALL = FLOATS + ",int64,int32,int16,int8,uint8,bool"
# The ops that move values without arithmetic (the copies cast between these exactly).
EXACT = ALL + ",fp64"
_EXACT = {"copy", "_to_copy", "clone", "sort", "topk", "cat", "flip", "repeat", "index_select", "gather", "index",
          "tril", "triu"}
# Forward ops whose kernels take only floating dtypes (the rest: integers and bools too). Every backward op
# is floating only: it computes a gradient, and autograd makes gradients of floating tensors alone.
_FLOAT_ONLY = {"softmax", "log_softmax", "_softmax", "_log_softmax", "gelu", "silu", "mm", "addmm", "bmm", "baddbmm",
               "mv", "native_layer_norm", "native_group_norm", "_fused_rms_norm", "mean", "var", "std", "var_mean",
               "std_mean", "_scaled_dot_product_flash_attention_for_cpu", "_grouped_mm", "histc", "log_sigmoid_forward",
               "logsumexp", "norm", "linalg_vector_norm", "uniform_", "normal_", "multinomial", "native_dropout",
               "mse_loss", "nll_loss_forward", "_foreach_norm", "dot", "hardtanh", "logit"}


class Declined(Exception):
    """Raised by an op's function, before any work, for an argument its kernel does not take: `ops.aten`
    gives the call to PyTorch's kernel."""


def dtypes_of(aten: str) -> tuple[str, ...]:
    """The dtypes that the routed ATen overload `aten` computes itself (its public op's row)."""
    return tuple(_DTYPES[public_name(aten)].split(","))


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
        out.append(Row(op, overloads, routes, _DTYPES[op]))
    return out


def _dtypes(op: str) -> str:
    if op in _EXACT:
        return EXACT
    return FLOATS if "backward" in op or op in _FLOAT_ONLY else ALL


_DTYPES = {public_name(aten): _dtypes(public_name(aten)) for _, aten in TABLE}


def summary() -> str:
    table = rows()
    forward = [r for r in table if r.routes != "backward"]
    return (f"{len(table)} public ATen ops routed ({len(forward)} forward, {len(table) - len(forward)} backward), "
            f"{len(TABLE)} overloads")
