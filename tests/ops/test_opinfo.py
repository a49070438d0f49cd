"""PyTorch's own op tests against the ATen table: for every routed op with an OpInfo in PyTorch's database
(`torch.testing._internal.common_methods_invocations.op_db`), its sample inputs in each dtype the op computes
itself (its row of `python -m ops list`, among fp32, bf16, fp16, int64 and bool, as the OpInfo declares them),
run under `ops.use_kernels()` (every op routed) and by PyTorch: the function, in-place and out= variants, and
the fp32 input gradients where the OpInfo supports autograd. An input PyTorch refuses must be refused too.

Results are compared with `torch.testing.assert_close` at per-dtype tolerances (FlagGems' bar in fp32, about
one rounding of the result in bf16 and fp16); a 16-bit result is compared with PyTorch's result in that dtype
(PyTorch's CPU kernels compute 16-bit inputs in fp32 and round once, as ours do), for every op alike.

The random ops' OpInfos are left out here (their numbers differ from PyTorch's by design): tests/ops/families/
sampling.py holds them to PyTorch's contract on seeds and to their distributions.

The plain suite runs a fixed, covering share: each OpInfo's first sample in the first dtype it computes (fp32
where it takes floats), every variant. `pytest -m opinfo` (by hand: long under the interpreter) runs the first
sample in each of its other dtypes, and every sample in every dtype.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db  # it imports expecttest (the dev extra)

import ops
from ops.catalog import dtypes_of, rows
from tests.ops.conftest import DEVICE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int64": torch.int64,
          "bool": torch.bool}
TOLERANCES = {torch.float32: (1e-4, 1.3e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
# OpInfos whose ATen op is named otherwise in the table.
ALIASES = {"softmax": "_softmax", "log_softmax": "_log_softmax", "nn.functional.logsigmoid": "log_sigmoid_forward",
           "nn.functional.nll_loss": "nll_loss_forward"}
RANDOM = {"exponential", "normal", "uniform", "bernoulli", "multinomial", "nn.functional.dropout"}
# Ops whose indices among equal values PyTorch leaves unspecified: their values are compared, and the indices'
# shape and dtype.
TIES = {"sort", "topk"}


def _routed_name(info) -> str | None:
    names = {r.op: r for r in rows()}
    for candidate in (ALIASES.get(info.name), info.aten_name, info.name, info.name.split(".")[-1]):
        if candidate in names:
            return candidate
    return None


def _cases() -> list:
    cases = []
    for info in op_db:
        op = _routed_name(info)
        if op is None or info.name in RANDOM:
            continue
        overload = next(r.overloads[0] for r in rows() if r.op == op)
        supported = info.supported_dtypes(DEVICE)
        for key, dtype in DTYPES.items():
            if key in dtypes_of(overload) and dtype in supported:
                name = f"{info.name}{'.' + info.variant_test_name if info.variant_test_name else ''}-{key}"
                cases.append(pytest.param(info, dtype, id=name))
    return cases


CASES = _cases()


def _first_dtypes(cases: list) -> tuple[list, list]:
    """(each OpInfo's first case, its cases in the other dtypes)."""
    seen, first, other = set(), [], []
    for case in cases:
        info = case.values[0]
        key = (info.name, info.variant_test_name)
        (other if key in seen else first).append(case)
        seen.add(key)
    return first, other


FIRST_DTYPE, OTHER_DTYPES = _first_dtypes(CASES)


def _close(got, expected, dtype) -> None:
    if isinstance(expected, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            _close(g, e, dtype)
        return
    if not isinstance(expected, torch.Tensor):
        assert got == expected or (got != got and expected != expected), (got, expected)
        return
    atol, rtol = TOLERANCES.get(expected.dtype, TOLERANCES.get(dtype, (1e-4, 1.3e-5)))
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, equal_nan=True, check_stride=False)


def _run(fn, sample, routed: bool):
    """fn on a fresh copy of the sample's inputs: (result, the inputs after it, or the exception it raised)."""
    inp = sample.input.clone() if isinstance(sample.input, torch.Tensor) else sample.input
    try:
        if routed:
            with ops.use_kernels():
                return fn(inp, *sample.args, **sample.kwargs), inp, None
        return fn(inp, *sample.args, **sample.kwargs), inp, None
    except Exception as e:  # the refusal is the result compared
        return None, inp, e


def _compare(fn, sample, dtype) -> None:
    expected, expected_inp, refused = _run(fn, sample, False)
    got, got_inp, error = _run(fn, sample, True)
    if refused is not None:
        assert error is not None, f"PyTorch refuses ({refused}), ours returned"
        return
    assert error is None, f"PyTorch computes it, ours raised {error!r}"
    if getattr(fn, "__name__", "") in TIES:
        assert got[1].shape == expected[1].shape and got[1].dtype == expected[1].dtype
        got, expected = got[0], expected[0]
    _close(got, expected, dtype)
    if isinstance(expected_inp, torch.Tensor):
        _close(got_inp, expected_inp, dtype)


def _compare_out(info, sample, dtype) -> None:
    expected, _, refused = _run(info.op, sample, False)
    if refused is not None or not isinstance(expected, torch.Tensor):
        return
    out = torch.empty_like(expected)
    with ops.use_kernels():
        info.op(sample.input.clone(), *sample.args, **sample.kwargs, out=out)
    _close(out, expected, dtype)


def _gradients(fn, sample, routed: bool):
    inp = sample.input.detach().clone().requires_grad_()
    with ops.use_kernels() if routed else _nothing():
        out = fn(inp, *sample.args, **sample.kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return None
        total = sum((o * torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)).sum() for o in outs)
        (grad,) = torch.autograd.grad(total, inp, allow_unused=True)
    return grad


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check(info, dtype, samples) -> int:
    """Every variant of each sample, ours against PyTorch's; returns the number of (sample, variant) checks."""
    checked = 0
    for sample in samples:
        _compare(info.op, sample, dtype)
        checked += 1
        if info.inplace_variant is not None and isinstance(sample.input, torch.Tensor):
            _compare(info.inplace_variant, sample, dtype)
            checked += 1
        if info.supports_out and isinstance(sample.input, torch.Tensor):
            _compare_out(info, sample, dtype)
            checked += 1
        if dtype == torch.float32 and info.supports_autograd and isinstance(sample.input, torch.Tensor):
            try:
                expected = _gradients(info.op, sample, False)
            except RuntimeError:  # no derivative in PyTorch for this sample (scatter's reduce=): ours refuses too
                with pytest.raises(RuntimeError):
                    _gradients(info.op, sample, True)
                checked += 1
                continue
            if expected is not None:
                _close(_gradients(info.op, sample, True), expected, dtype)
                checked += 1
    return checked


@pytest.mark.parametrize(("info", "dtype"), FIRST_DTYPE)
def test_first_sample_matches_pytorch(info, dtype):
    samples = list(info.sample_inputs(DEVICE, dtype, requires_grad=False))[:1]
    assert check(info, dtype, samples) or not samples


@pytest.mark.opinfo
@pytest.mark.parametrize(("info", "dtype"), OTHER_DTYPES)
def test_first_sample_in_the_other_dtypes_matches_pytorch(info, dtype):
    test_first_sample_matches_pytorch(info, dtype)


@pytest.mark.opinfo
@pytest.mark.parametrize(("info", "dtype"), CASES)
def test_every_sample_matches_pytorch(info, dtype):
    check(info, dtype, list(info.sample_inputs(DEVICE, dtype, requires_grad=False)))
