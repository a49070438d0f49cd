"""bench/parallel_memory.py's `--model-overrides`: the cp rows' model is `model=debug` changed by them (a wider
one shows what cp divides against the memory no degree divides), in the trainer's command and in the harness's
own model; anything but `model.<key>=<value>` is refused in one line, exit 2, before any run; `--allocator` is the
ranks' train.allocator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.bench_script import load

REPO = Path(__file__).resolve().parents[2]
WIDE = ["model.dim=512", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=1376"]


def test_an_override_outside_model_is_refused_in_one_line_before_any_run():
    run = subprocess.run([sys.executable, "bench/parallel_memory.py", "--model-overrides", "train.max_steps=3"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith(
        "error: --model-overrides 'train.max_steps=3': each must be model.<key>=<value>")
    assert run.stdout == ""


def test_the_overrides_reach_the_trainers_command_and_the_harness_model():
    parallel_memory = load("parallel_memory")
    args = parallel_memory.trainer_args(4, 8192, 1, WIDE, "adaptive", "/tmp/run")
    assert args[3:9] == ["model=debug", *WIDE, "model.max_seq_len=8192"]
    assert "strategy.cp=4" in args and "train.allocator=adaptive" in args
    model = parallel_memory.debug_model(256, WIDE)
    block = model.layers["0"]
    assert model.tok_embeddings.weight.shape[1] == 512
    assert block.attention.wk.weight.shape == (4 * 64, 512)
    assert block.feed_forward.w1.weight.shape == (1376, 512)
