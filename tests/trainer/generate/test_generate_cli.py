"""`python -m trainer.generate`: on a Hugging Face directory and on training checkpoints (`model=hf` and a
preset) it prints what `transformers`' greedy `generate` writes on the same weights and tokenizer, chat
template included; bad input is refused in one line with exit 2."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.conftest import TINY, cli
from tests.trainer.hf_models import add_tokenizer, make_llama, make_qwen2
from trainer import export
from trainer.generate import left_padded

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["how are you?", "def main():\n    return"]
STEPS = ["train.max_steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.progress=false",
         "data.seq_len=32", "train.global_batch_size=8"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return add_tokenizer(make_qwen2(str(tmp_path_factory.mktemp("hf"))))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, cache_dir, hf_dir):
    """Two-step runs, `model=hf` from `hf_dir` (whole, and with LoRA adapters) and the tiny preset, and their
    last checkpoints."""
    root = tmp_path_factory.mktemp("runs")
    found = {}
    runs = {"hf": ["model=hf", f"model.path={hf_dir}", *STEPS], "preset": [*TINY, *STEPS],
            "lora": ["model=hf", f"model.path={hf_dir}", "peft=lora", "optim.lr=0.5", *STEPS]}
    for name, overrides in runs.items():
        proc = cli(cache_dir, root, *overrides, f"hydra.run.dir={root / name}", timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[name] = str(root / name / "checkpoints" / "step-2")
    return found


def _generate_cli(run_cli, source: str, *args: str) -> list[dict]:
    proc = run_cli(source, *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "12", "--json", *args,
                   module="trainer.generate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _transformers_greedy(model_dir: str, prompts: list[list[int]], eos: list[int], pad: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, valid = left_padded(prompts, pad)
    out = model.generate(input_ids=tokens, attention_mask=valid.long(), max_new_tokens=12, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad)
    return [_cut(row, eos) for row in out[:, tokens.shape[1] :].tolist()]


def _cut(row: list[int], eos: list[int]) -> list[int]:
    ends = [i for i, t in enumerate(row) if t in eos]
    return row[: ends[0] + 1] if ends else row


def _hf_reference(model_dir: str, tokenizer_dir: str, chat: bool) -> tuple[list[list[int]], object]:
    """transformers' greedy tokens for PROMPTS, tokenized (and chat-templated) by transformers' tokenizer. It is
    PreTrainedTokenizerFast, as tokenizer_config.json says: transformers 5's AutoTokenizer picks Qwen2Tokenizer
    from config.json's model_type, which replaces the test tokenizer's pre-tokenizer with Qwen2's own."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    if chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in PROMPTS]
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
    configured = GenerationConfig.from_pretrained(model_dir).eos_token_id
    configured = [] if configured is None else [configured] if isinstance(configured, int) else configured
    eos = sorted({tok.eos_token_id, *configured})
    return _transformers_greedy(model_dir, prompts, eos, tok.pad_token_id), tok


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.e2e
def test_on_a_hugging_face_dir_it_prints_transformers_greedy_completion(hf_dir, run_cli, chat):
    results = _generate_cli(run_cli, hf_dir, *(["--chat"] if chat else []))
    reference, tok = _hf_reference(hf_dir, hf_dir, chat)
    assert [r["prompt"] for r in results] == PROMPTS
    assert [r["token_ids"] for r in results] == reference
    assert [r["completion"] for r in results] == [tok.decode(ids, skip_special_tokens=True) for ids in reference]
    plain = run_cli(hf_dir, "--prompt", PROMPTS[0], "--max-new-tokens", "12", *(["--chat"] if chat else []),
                    module="trainer.generate")
    assert plain.returncode == 0 and plain.stdout == results[0]["completion"] + "\n"


@pytest.mark.e2e
def test_on_a_model_hf_checkpoint_it_generates_from_the_trained_weights(checkpoints, hf_dir, run_cli, tmp_path):
    results = _generate_cli(run_cli, checkpoints["hf"], "--chat")
    exported = export.export(checkpoints["hf"], str(tmp_path / "exported"))
    reference, _ = _hf_reference(exported, hf_dir, chat=True)
    assert [r["token_ids"] for r in results] == reference
    # Training moved the weights, and what they write.
    assert reference != _hf_reference(hf_dir, hf_dir, chat=True)[0]


def test_on_a_lora_checkpoint_it_generates_with_the_adapters_on(checkpoints, hf_dir, run_cli, tmp_path):
    # A large learning rate moves the adapters far enough in two steps to change what greedy decoding writes.
    results = _generate_cli(run_cli, checkpoints["lora"])
    merged = export.export(checkpoints["lora"], str(tmp_path / "merged"), merge=True)
    reference, _ = _hf_reference(merged, hf_dir, chat=False)
    assert [r["token_ids"] for r in results] == reference
    assert reference != _hf_reference(hf_dir, hf_dir, chat=False)[0]


def test_on_a_preset_checkpoint_it_uses_the_byte_tokenizer(checkpoints, run_cli, tmp_path):
    from trainer.data import tokenizer

    results = _generate_cli(run_cli, checkpoints["preset"])
    exported = export.export(checkpoints["preset"], str(tmp_path / "exported"))
    prompts = [tokenizer.encode(p, eos=False).tolist() for p in PROMPTS]
    reference = _transformers_greedy(exported, prompts, [tokenizer.EOS], tokenizer.PAD)
    assert [r["token_ids"] for r in results] == reference
    assert [r["completion"] for r in results] == [tokenizer.decode(ids) for ids in reference]


def test_bad_input_is_refused_in_one_line_with_exit_2(checkpoints, hf_dir, run_cli_batch, tmp_path):
    no_tokenizer = make_llama(str(tmp_path))
    no_template = str(tmp_path / "no-template")
    shutil.copytree(hf_dir, no_template)
    with open(os.path.join(no_template, "tokenizer_config.json")) as f:
        config = json.load(f)
    del config["chat_template"]
    with open(os.path.join(no_template, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    cases = [
        ([str(tmp_path), "--prompt", "x"], f"SOURCE='{tmp_path}': must be a checkpoint"),
        ([hf_dir, "--prompt", "x", "--temperature", "-1"], "--temperature=-1.0: must be >= 0 (0 is greedy)"),
        ([hf_dir, "--prompt", "x", "--top-k", "-2"], "--top-k=-2: must be >= 0"),
        ([hf_dir, "--prompt", "x", "--top-p", "1.5"], "--top-p=1.5: must be in (0, 1]"),
        ([hf_dir, "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0: must be >= 1"),
        ([hf_dir, "--prompt", "x", "--max-new-tokens", "1000"], "the model has 256 positions"),
        ([hf_dir, "--prompt", ""], "--prompt='': every prompt needs some text"),
        ([no_tokenizer, "--prompt", "x"], "holds no tokenizer.json"),
        ([no_template, "--prompt", "x", "--chat"], "has no chat template"),
        ([checkpoints["preset"], "--prompt", "x", "--chat"], "byte tokenizer has no chat template"),
    ]
    procs = run_cli_batch([(args, str(tmp_path)) for args, _ in cases], module="trainer.generate")
    for (args, message), proc in zip(cases, procs, strict=True):
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stdout == ""
        assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, (args, proc.stderr)
