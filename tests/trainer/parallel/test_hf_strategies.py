"""Fine-tuning a Hugging Face model under ddp, fsdp2 and tp on 2 CPU processes (real torchrun, gloo) gives
the single-process losses, each rank reading only its own slices of the safetensors; a single-process
checkpoint resumes under fsdp2, and an fsdp2 checkpoint exports to the single process's weights. One
module fixture runs the single-process reference; the model is a tiny random Llama with tied embeddings
made here (under tp the embedding's vocabulary rows also project the logits), fine-tuned with SFT on packed
conversations (attention and positions stay within each conversation on every rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import read_metrics, read_summary
from tests.trainer.hf_models import add_tokenizer, make_llama
from tests.trainer.recipes.test_sft import _chats
from trainer import export

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
# As in test_strategies: sharded sums differ by float rounding only; a wrong shard moves the loss by > 1e-2.
RTOL = 1e-4
DIST = ["+runtime=torch-distributed", "runtime.nproc_per_node=2"]


def _run(args: list[str], run_dir, cache_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args, f"hydra.run.dir={run_dir}"],
        env={**os.environ, "TRAINJOB_CACHE": cache_dir},
        capture_output=True,
        text=True,
        cwd=run_dir.parent,
        timeout=300,
    )


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("hf-strategies")
    model = add_tokenizer(make_llama(str(root), tie=True))
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _chats(48, seed=1)))
    args = [
        "model=hf",
        f"model.path={model}",
        "recipe=sft",
        "data=chat",
        f"data.path={path}",
        "data.seq_len=48",
        "data.eval_percent=25",
        "train.global_batch_size=4",
        "train.max_steps=4",
        "train.eval_every=4",
        "train.checkpoint_every=2",
        "train.progress=false",
        "train.log_every=1",
        "lr_schedule.warmup_steps=1",
    ]
    run_dir = root / "single"
    proc = _run(args, run_dir, cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return args, run_dir


@pytest.mark.e2e
def test_a_single_process_checkpoint_resumes_under_fsdp2_with_the_same_losses(single, tmp_path, cache_dir):
    args, ref_dir = single
    run_dir = tmp_path / "resumed"
    proc = _run(
        [*args, *DIST, "strategy=fsdp2", f"train.resume={ref_dir / 'checkpoints' / 'step-2'}"], run_dir, cache_dir
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, ref = read_metrics(str(run_dir)), read_metrics(str(ref_dir))
    assert [m["step"] for m in ours] == [3, 4]
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in ref[2:]], rel=RTOL)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "tp"])
@pytest.mark.e2e
def test_a_fine_tune_under_each_strategy_gives_the_single_process_losses(single, strategy, tmp_path, cache_dir):
    args, ref_dir = single
    run_dir = tmp_path / strategy
    proc = _run([*args, *DIST, f"strategy={strategy}"], run_dir, cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, ref = read_metrics(str(run_dir)), read_metrics(str(ref_dir))
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in ref], rel=RTOL)
    assert [m["grad_norm"] for m in ours] == pytest.approx([m["grad_norm"] for m in ref], rel=RTOL)
    assert read_summary(str(run_dir))["final_eval_loss"] == pytest.approx(
        read_summary(str(ref_dir))["final_eval_loss"], rel=RTOL
    )
    if strategy == "fsdp2":  # a sharded checkpoint exports to the single process's model
        mine, theirs = (
            export.load_model(
                str(run_dir / "checkpoints" / "step-4"), export.run_config(str(run_dir / "checkpoints" / "step-4"))
            ),
            export.load_model(
                str(ref_dir / "checkpoints" / "step-4"), export.run_config(str(ref_dir / "checkpoints" / "step-4"))
            ),
        )
        # Adam moves a weight by ~lr whatever its gradient's size: a near-zero gradient's noise shows as ~1e-6.
        for (name, a), b in zip(mine.named_parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
