"""The optimizers' `_foreach_*` ops as loops over the generated pointwise kernels: one launch per tensor, each
computed in fp32 (clipping's `_foreach_norm` and `_foreach_mul_.Tensor` are the multi-tensor kernels of
`ops.multi_tensor`, one launch for a whole list). `ATEN` holds the rows `ops.aten` routes: for each op the
functional and in-place forms with a Scalar, a List, a ScalarList or a Tensor second operand.
"""

from __future__ import annotations

from ops import pointwise_ops as pw

BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "pow")
UNARY = ("sqrt", "exp", "log", "abs", "neg", "sign", "reciprocal", "sigmoid", "tanh", "rsqrt", "sin", "cos")


def _operands(other, n):
    return list(other) if isinstance(other, (list, tuple)) else [other] * n


def _binary(name, inplace):
    fn = pw.OPS[name]

    def impl(self, other, *, alpha=1):
        results = []
        for t, o in zip(self, _operands(other, len(self)), strict=True):
            o = pw.mul(o, alpha) if alpha != 1 else o
            results.append(pw._into_self(fn, t, o) if inplace else fn(t, o))
        return None if inplace else results

    return impl


def _unary(name, inplace):
    fn = pw.OPS[name]

    def impl(self):
        results = [pw._into_self(fn, t) if inplace else fn(t) for t in self]
        return None if inplace else results

    return impl


def _ternary(name, inplace):
    fn = pw.OPS[name]

    def impl(self, tensor1, tensor2, value=1):
        values = value.tolist() if hasattr(value, "tolist") else value
        results = [pw._into_self(fn, t, a, b, v) if inplace else fn(t, a, b, v)
                   for t, a, b, v in zip(self, tensor1, tensor2, _operands(values, len(self)), strict=True)]
        return None if inplace else results

    return impl


def _lerp(inplace):
    def impl(self, tensors1, weight):
        results = [pw._into_self(pw.OPS["lerp"], t, e, w) if inplace else pw.OPS["lerp"](t, e, w)
                   for t, e, w in zip(self, tensors1, _operands(weight, len(self)), strict=True)]
        return None if inplace else results

    return impl


def _zero_(self):
    for t in self:
        pw.OPS["fill"](t, 0, out=t)


def _copy_(self, src, non_blocking=False):
    for t, s in zip(self, src, strict=True):
        t.copy_(s)


def _rows():
    import torch

    rows = []
    for name in BINARY:
        for suffix, inplace in (("", False), ("_", True)):
            aten = getattr(torch.ops.aten, f"_foreach_{name}{suffix}")
            for overload in ("Scalar", "List", "ScalarList", "Tensor"):
                if overload in aten.overloads() and not (name == "pow" and overload == "Tensor"):
                    rows.append((f"_foreach_{name}", f"_foreach_{name}{suffix}.{overload}", _binary(name, inplace)))
    for name in UNARY:
        rows += [(f"_foreach_{name}", f"_foreach_{name}", _unary(name, False)),
                 (f"_foreach_{name}", f"_foreach_{name}_", _unary(name, True))]
    for name in ("addcmul", "addcdiv"):
        for suffix, inplace in (("", False), ("_", True)):
            rows += [(f"_foreach_{name}", f"_foreach_{name}{suffix}.{o}", _ternary(name, inplace))
                     for o in ("Scalar", "ScalarList", "Tensor")]
    rows += [("_foreach_lerp", "_foreach_lerp.Scalar", _lerp(False)), ("_foreach_lerp", "_foreach_lerp_.Scalar",
                                                                       _lerp(True)),
             ("_foreach_lerp", "_foreach_lerp.List", _lerp(False)), ("_foreach_lerp", "_foreach_lerp_.List",
                                                                     _lerp(True)),
             ("_foreach_zero_", "_foreach_zero_", _zero_), ("_foreach_copy_", "_foreach_copy_", _copy_)]
    # clipping's multi-tensor forms are ops.aten's own rows
    return [r for r in rows if r[1] not in ("_foreach_mul_.Tensor",)]


ATEN = _rows()
