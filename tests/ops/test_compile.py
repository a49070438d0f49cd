"""Every Triton kernel specialisation the op tests launch compiles for Hopper (sm_90) and Ampere (sm_80),
on a machine without a GPU: the launches the op tests made under the interpreter are recorded
(tests/ops/launches.py; in this session when it ran every op test to a pass, else by running them once
more), the launches at Llama-3-8B's shapes are recorded (not run), then `triton.compile` builds each
recorded launch down to a cubin.

The interpreter accepts code that the compiler refuses (a plain module global read by a kernel, for one),
so this is the check that keeps such code from reaching a GPU first. On a machine with a GPU the op
tests compile every kernel for that GPU themselves, and this test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.ops.conftest import RECORD
from tests.ops.launches import RECORD_ENV

ARCHS = ["90", "80"]


def _env(**changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(changes)
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="the op tests compile every kernel for this GPU")
@pytest.mark.timeout(1200)
def test_every_launched_kernel_compiles_for_sm90_and_sm80(request, launch_record, tmp_path):
    if RECORD.complete(request.config):  # every op test ran in this session, recording its launches
        record = Path(launch_record)
    else:
        record = tmp_path / "launches.jsonl"
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "tests.ops.launches", "-p", "no:cacheprovider",
             os.path.join("tests", "ops", "test_ops.py")],
            cwd=REPO, env=_env(TRITON_INTERPRET="1", **{RECORD_ENV: str(record)}), capture_output=True, text=True,
            timeout=900)
        assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    shapes = subprocess.run([sys.executable, "-m", "tests.ops.launches", "record-model-shapes", str(record)],
                            cwd=REPO, env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert shapes.returncode == 0, shapes.stdout[-3000:] + shapes.stderr[-3000:]
    specs = [json.loads(line) for line in record.read_text().splitlines()]
    # The model's shapes reach the settings the small test shapes do not: rows held whole at 4096
    # columns, 16 warps over the vocabulary, the largest matmul tiles.
    assert any(s["kernel"]["name"] == "_matmul" and s["constexprs"]["BN"] == 256 for s in specs)
    assert any(s["kernel"]["name"] == "_norm_fwd" and s["constexprs"]["BLOCK"] == 4096 for s in specs)
    assert any(s["kernel"]["name"] == "_ce_loss" and s["options"]["num_warps"] == 16 for s in specs)
    kernels = {json.loads(line)["kernel"]["name"] for line in record.read_text().splitlines()}
    # Every family of kernels was seen, generated pointwise kernels included.
    for name in ("_norm_fwd", "_norm_bwd", "_softmax_fwd", "_softmax_bwd", "_rope", "_ce_loss", "_ce_grad",
                 "_matmul", "_pw_T_o1_r1", "_pw_TTT_o2_r1"):
        assert name in kernels, f"{name} was never launched by the op tests"
    built = subprocess.run([sys.executable, "-m", "tests.ops.launches", str(record), *ARCHS], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-6000:] + built.stderr[-3000:]
    assert " 0 failed" in built.stdout
