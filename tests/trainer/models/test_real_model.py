"""A real pretrained model through the fine-tuning commands, as a user brings it: SmolLM2-135M-Instruct
(Llama architecture, tied embeddings, dequantized from the GGUF of its PyPI package; `tests.trainer.real_models`)
with its stock chat template, which has no `{% generation %}` blocks. `recipe=sft` with LoRA counts exactly the
tokens that transformers' `return_assistant_tokens_mask` marks on the same template with generation blocks,
its export loads in transformers and PEFT with our logits, and `recipe=dpo` trains on the same model."""

from __future__ import annotations

import glob
import json
import math
import os
import random

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import cli, read_metrics
from tests.trainer import real_models
from tests.trainer.data.test_chat_templates import _generation_blocks
from trainer import export

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
SEQ = 48
QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hi.", "What is the capital of France?", "Count to three."]
ANSWERS = ["4.", "Blue.", "Hi!", "Paris.", "One, two, three."]
TRAIN = ["train.global_batch_size=4", "train.progress=false", "train.log_every=1", "lr_schedule.warmup_steps=0",
         f"data.seq_len={SEQ}", "data.eval_percent=20", "train.max_steps=3", "train.eval_every=3",
         "train.checkpoint_every=3", "peft=lora", "peft.rank=4", "peft.alpha=8", "peft.dropout=0.0",
         "peft.target_modules=[q_proj,v_proj]"]


def _conversations(n: int) -> list[list[dict]]:
    rng = random.Random(0)
    chats = []
    for _ in range(n):
        i, j = rng.randrange(5), rng.randrange(5)
        chats.append([{"role": "user", "content": QUESTIONS[i]}, {"role": "assistant", "content": ANSWERS[i]},
                      *([{"role": "user", "content": QUESTIONS[j]}, {"role": "assistant", "content": ANSWERS[j]}]
                        if rng.random() < 0.5 else [])])
    return chats


@pytest.fixture(scope="module")
def smollm2():
    return real_models.smollm2()


@pytest.fixture(scope="module")
def sft_run(smollm2, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("real-sft")
    chats = _conversations(40)
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    run_dir = root / "run"
    proc = cli(cache_dir, root, "model=hf", f"model.path={smollm2}", "recipe=sft", "data=chat", f"data.path={path}",
               *TRAIN, "optim.lr=1e-2", f"hydra.run.dir={run_dir}", timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return chats, str(run_dir), cache_dir


def _info(corpus: str) -> dict:
    with open(os.path.join(corpus, "corpus.json")) as f:
        return json.load(f)


@pytest.mark.e2e
def test_sft_on_the_stock_template_counts_exactly_the_assistant_tokens(smollm2, sft_run):
    from transformers import AutoTokenizer

    chats, run_dir, cache_dir = sft_run
    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert len(losses) == 3 and all(np.isfinite(losses))
    tok = AutoTokenizer.from_pretrained(smollm2)
    marked = _generation_blocks("smollm2", tok.chat_template)
    expected = set()
    for messages in chats:
        ref = tok.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = list(ref["input_ids"])[: SEQ + 1], list(ref["assistant_masks"])[: SEQ + 1]
        pad = SEQ + 1 - len(ids)
        expected.add((tuple(ids + [tok.pad_token_id] * pad), tuple(mask + [0] * pad)))
    (corpus,) = [d for d in glob.glob(os.path.join(cache_dir, "corpus", "chat-*"))
                 if _info(d)["source"]["files"][0][0].startswith(os.path.dirname(run_dir))]
    rows = set()
    for file in sorted(glob.glob(os.path.join(corpus, "*", "*.parquet"))):
        table = pq.read_table(file).to_pylist()
        rows |= {(tuple(r["tokens"]), tuple(r["loss_mask"])) for r in table}
    assert rows == expected
    assert _info(corpus)["dropped"] == {}


@pytest.mark.e2e
def test_the_exported_model_gives_our_logits_in_transformers_and_peft(smollm2, sft_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run_dir, _ = sft_run
    checkpoint = os.path.join(run_dir, "checkpoints", "step-3")
    tokens = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = export.load_model(checkpoint, export.run_config(checkpoint)).eval()(tokens)
    adapters, merged = str(tmp_path / "adapters"), str(tmp_path / "merged")
    assert export.main([checkpoint, adapters]) == 0
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():
        assert (base(tokens).logits - ours).abs().max() > 1e-3  # the adapters trained
        # Logits of magnitude up to ~10 in fp32 through 30 layers: a few parts in 1e5 apart.
        torch.testing.assert_close(PeftModel.from_pretrained(base, adapters).eval()(tokens).logits, ours,
                                   rtol=5e-5, atol=1e-4)
    assert export.main([checkpoint, merged, "--merge"]) == 0
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        # Folded weights round differently from the adapters' two matmuls: 1e-4 and fp32's relative error.
        torch.testing.assert_close(full(tokens).logits, ours, rtol=2e-5, atol=1e-4)


@pytest.mark.e2e  # the DPO recipe's own tests (recipes/test_dpo.py) run in `pytest` on tiny models
def test_dpo_trains_the_real_model_on_its_stock_template(smollm2, tmp_path, cache_dir):
    rng = random.Random(1)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": QUESTIONS[i], "chosen": ANSWERS[i], "rejected": ANSWERS[i - 1]})
                            + "\n" for i in (rng.randrange(5) for _ in range(30))))
    proc = cli(cache_dir, tmp_path, "model=hf", f"model.path={smollm2}", "recipe=dpo", "data=preference",
               f"data.path={path}", *TRAIN, "optim.lr=5e-3", "recipe.beta=0.5", f"hydra.run.dir={tmp_path / 'run'}",
               timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(str(tmp_path / "run"))
    # Step 1 is the reference itself (the adapters start at zero): loss log 2; then the margin grows.
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert metrics[-1]["rewards/margins"] > 0 and metrics[-1]["loss"] < math.log(2)
