"""The op tests of softmax and log-softmax, long rows and rows that start with -inf."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import GENERATED, _check, _leaf, dtypes


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_and_log_softmax(dim):
    x = _leaf(3, 1100, 5, transpose=True)
    _check(lambda a: ops.softmax(a, dim), lambda a: torch.softmax(a, dim), [x], reduced=1100)
    _check(lambda a: ops.log_softmax(a, dim), lambda a: torch.log_softmax(a, dim), [x], reduced=1100)


@pytest.mark.timeout(300)
@GENERATED
@given(shape=st.lists(st.integers(1, 12), min_size=1, max_size=3), long_row=st.booleans(), data=st.data(),
       dtype=dtypes, log=st.booleans())
def test_softmax_generated(shape, long_row, data, dtype, log):
    if long_row:  # a row longer than one block is walked in blocks
        shape, dim = [shape[0] % 3 + 1, 9000], -1
    else:
        dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = _leaf(*shape, dtype=dtype, transpose=data.draw(st.booleans()), scale=4.0)
    ours, ref = (ops.log_softmax, torch.log_softmax) if log else (ops.softmax, torch.softmax)
    _check(lambda a: ours(a, dim), lambda a: ref(a, dim), [x], reduced=shape[dim], dtype=dtype, like_eager=True)


def test_rows_that_start_with_a_block_of_minus_infinity():
    """The online max over blocks of a long row must not turn -inf - -inf into NaN (masked vocabularies)."""
    x = torch.randn(2, 9000, device=DEVICE)
    x[:, :8192] = float("-inf")
    torch.testing.assert_close(ops.softmax(x, -1), torch.softmax(x, -1))
    torch.testing.assert_close(ops.log_softmax(x, -1), torch.log_softmax(x, -1))
    target = torch.tensor([8500, 8999], device=DEVICE)
    torch.testing.assert_close(ops.cross_entropy(x, target), F.cross_entropy(x, target))
