"""Where the op tests run: on CUDA tensors with compiled kernels when a GPU is present, else on CPU tensors
under Triton's interpreter (the root conftest sets TRITON_INTERPRET=1 when there is no GPU).

Under the interpreter the op tests (test_ops.py) record every kernel specialisation they launch
(tests/ops/launches.py, through that file's fixtures), and its last test compiles those for real GPUs.
`RECORD` says whether this session ran every op test to a pass; when it did not (a selection, or a
failure), that test runs them again itself to record their launches.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OP_TESTS = "tests/ops/test_ops.py"
COMPILE_TEST = f"{OP_TESTS}::test_every_launched_kernel_compiles_for_sm90_and_sm80"


class OpTestRecord:
    """The op tests this session collected and passed, and whether any was deselected."""

    def __init__(self) -> None:
        self.collected: set[str] = set()
        self.passed: set[str] = set()
        self.deselected = False

    def complete(self, config: pytest.Config) -> bool:
        """Every op test ran here and passed (test_ops.py was collected whole: no node id, no -k or -m)."""
        whole = not any(f"{OP_TESTS}::" in str(arg).replace(os.sep, "/") for arg in config.args)
        return whole and not self.deselected and bool(self.collected) and self.passed == self.collected


RECORD = OpTestRecord()  # this session's (pytest_runtest_logreport is given no config to stash it in)


def _is_op_test(nodeid: str) -> bool:
    return nodeid.startswith(f"{OP_TESTS}::") and nodeid != COMPILE_TEST


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    RECORD.collected = {item.nodeid for item in items if _is_op_test(item.nodeid)}


def pytest_deselected(items: list[pytest.Item]) -> None:
    if any(_is_op_test(item.nodeid) for item in items):
        RECORD.deselected = True


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _is_op_test(report.nodeid) and report.when == "call" and report.passed:
        RECORD.passed.add(report.nodeid)


@pytest.fixture(params=DTYPES, ids=["fp32", "bf16", "fp16"])
def dtype(request) -> torch.dtype:
    return request.param
