"""The optimizers' `_foreach_*` ops as loops over the generated pointwise kernels: one launch per tensor, each
computed in fp32 (clipping's `_foreach_norm` and `_foreach_mul_.Tensor` are the multi-tensor kernels of
`ops.multi_tensor`, one launch for a whole list). `ATEN` holds the functions of the overloads of
`ops.aten_routes`' "foreach" family, each made from its name: for each op the functional and in-place forms
with a Scalar, a List, a ScalarList or a Tensor second operand.
"""

from __future__ import annotations

from ops import pointwise_ops
from ops.aten_routes import ROUTES
from ops.pointwise_ops import OPS


def _operands(other, n):
    return list(other) if isinstance(other, (list, tuple)) else [other] * n


def _binary(name, inplace):
    fn = OPS[name]

    def impl(self, other, *, alpha=1):
        results = []
        for t, o in zip(self, _operands(other, len(self)), strict=True):
            o = pointwise_ops.mul(o, alpha) if alpha != 1 else o
            results.append(pointwise_ops.into_self(fn, t, o) if inplace else fn(t, o))
        return None if inplace else results

    return impl


def _unary(name, inplace):
    fn = OPS[name]

    def impl(self):
        results = [pointwise_ops.into_self(fn, t) if inplace else fn(t) for t in self]
        return None if inplace else results

    return impl


def _ternary(name, inplace):
    fn = OPS[name]

    def impl(self, tensor1, tensor2, value=1):
        values = value.tolist() if hasattr(value, "tolist") else value
        results = [pointwise_ops.into_self(fn, t, a, b, v) if inplace else fn(t, a, b, v)
                   for t, a, b, v in zip(self, tensor1, tensor2, _operands(values, len(self)), strict=True)]
        return None if inplace else results

    return impl


def _lerp(inplace):
    def impl(self, tensors1, weight):
        results = [pointwise_ops.into_self(OPS["lerp"], t, e, w) if inplace else OPS["lerp"](t, e, w)
                   for t, e, w in zip(self, tensors1, _operands(weight, len(self)), strict=True)]
        return None if inplace else results

    return impl


def _zero_(self):
    for t in self:
        OPS["fill"](t, 0, out=t)


def _copy_(self, src, non_blocking=False):
    for t, s in zip(self, src, strict=True):
        t.copy_(s)


def _function(aten: str):
    """The function of a `_foreach_<op>` overload, from its name: in place when the name ends in `_`, binary
    when it names its second operand (`.Scalar`, `.List`, `.ScalarList`, `.Tensor`)."""
    name = aten.split(".")[0]
    inplace, op = name.endswith("_"), name.removeprefix("_foreach_").rstrip("_")
    if op in ("zero", "copy"):
        return {"zero": _zero_, "copy": _copy_}[op]
    if op in ("addcmul", "addcdiv"):
        return _ternary(op, inplace)
    if op == "lerp":
        return _lerp(inplace)
    return _binary(op, inplace) if "." in aten else _unary(op, inplace)


ATEN = {aten: _function(aten) for atens in ROUTES["foreach"].values() for aten in atens}
