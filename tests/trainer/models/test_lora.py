"""`peft=lora`: the base stays frozen, the adapters train, and `python -m trainer.export` writes them as PEFT
does (`peft.PeftModel.from_pretrained` gives our logits) or, with `--merge`, folded into a whole model.
Under tensor parallelism (2 CPU processes, real torchrun and gloo) the adapters give the single process's
losses. The bases are tiny random Llama and Qwen2 models made with `transformers` (nothing downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import cli, compose_refused, read_metrics
from tests.trainer.hf_models import add_tokenizer, make_llama, make_qwen2
from trainer import export
from trainer.models import from_hf

pytestmark = pytest.mark.timeout(300)
TARGETS = "[q_proj,v_proj,down_proj]"
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8", "peft.dropout=0.1", f"peft.target_modules={TARGETS}"]
TOKENS = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))


TRAIN = [
    "optim.lr=0.05",
    "lr_schedule.warmup_steps=0",
    "train.max_steps=3",
    "train.eval_every=3",
    "train.checkpoint_every=3",
    "train.progress=false",
    "train.log_every=1",
    "data.seq_len=32",
    "train.global_batch_size=8",
]


def _train(root, run_dir, args: list[str], cache_dir: str) -> None:
    proc = cli(cache_dir, root, *args, *TRAIN, f"hydra.run.dir={run_dir}", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("lora")
    base = add_tokenizer(make_llama(str(root)))
    run_dir = root / "run"
    _train(root, run_dir, ["model=hf", f"model.path={base}", *LORA], cache_dir)
    return base, str(run_dir / "checkpoints" / "step-3"), str(run_dir)


def _logits(model, tokens=TOKENS):
    with torch.no_grad():
        out = model.eval()(tokens)
    return out.logits if hasattr(out, "logits") else out


def test_the_base_is_frozen_and_the_adapters_train(lora_run):
    base, checkpoint, run_dir = lora_run
    ours = dict(export.load_model(checkpoint, export.run_config(checkpoint)).named_parameters())
    pretrained = dict(from_hf(base).named_parameters())
    assert set(ours) - set(pretrained) == {
        f"layers.{i}.{m}.lora_{ab}.weight"
        for i in (0, 1)
        for m in ("attention.wq", "attention.wv", "feed_forward.w2")
        for ab in "AB"
    }
    for name, value in pretrained.items():
        assert torch.equal(ours[name], value), name
    assert all(ours[n].abs().max() > 0 for n in ours if ".lora_B." in n)  # B starts at zero; it moved
    assert len(read_metrics(run_dir)) == 3


def test_adapters_load_in_peft_with_our_logits_and_merge_into_the_same_model(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, checkpoint, _ = lora_run
    ours = _logits(export.load_model(checkpoint, export.run_config(checkpoint)))
    assert (ours - _logits(from_hf(base))).abs().max() > 1e-4  # the adapters change the model

    adapters = str(tmp_path / "adapters")
    assert export.main([checkpoint, adapters]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(adapters))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters)
    torch.testing.assert_close(_logits(peft_model), ours, rtol=0, atol=1e-5)

    merged = str(tmp_path / "merged")
    assert export.main([checkpoint, merged, "--merge"]) == 0
    assert "adapter_config.json" not in os.listdir(merged)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(merged)), ours, rtol=0, atol=1e-5)


def test_lora_that_cannot_run_is_refused_naming_the_key(lora_run, tmp_path, capsys):
    base, _, _ = lora_run
    hf = ["model=hf", f"model.path={base}"]
    assert "peft='lora': LoRA adapts a pretrained model: use model=hf" in compose_refused(tmp_path, capsys, "peft=lora")
    err = compose_refused(tmp_path, capsys, *hf, "peft=lora", "peft.target_modules=[q_proj,wq]")
    assert "peft.target_modules=['q_proj', 'wq']: a llama model has q_proj, k_proj, v_proj, o_proj" in err
    assert "peft.rank=0: must be > 0" in compose_refused(tmp_path, capsys, *hf, "peft=lora", "peft.rank=0")


@pytest.mark.slow
@pytest.mark.e2e
def test_adapters_under_tensor_parallelism_give_the_single_process_losses(tmp_path, cache_dir):
    """Qwen2 (q/k/v biases, tied embeddings) with adapters on column-wise (q, v, up) and row-wise (o, down)
    layers; no dropout, whose masks a sharded layer draws differently. The tp checkpoint's adapters load in
    PEFT with the logits of our model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = add_tokenizer(make_qwen2(str(tmp_path)))
    args = ["model=hf", f"model.path={base}", "peft=lora", "peft.rank=4", "peft.alpha=8",
            "peft.target_modules=[q_proj,v_proj,o_proj,up_proj,down_proj]"]
    _train(tmp_path, tmp_path / "single", args, cache_dir)
    _train(tmp_path, tmp_path / "tp", [*args, "+runtime=torch-distributed", "runtime.nproc_per_node=2",
                                       "strategy=tp"], cache_dir)
    ours, ref = read_metrics(str(tmp_path / "tp")), read_metrics(str(tmp_path / "single"))
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in ref], rel=1e-4)
    assert ref[2]["loss"] < ref[0]["loss"] - 0.1  # the adapters learn, so a wrong shard would show

    checkpoint = str(tmp_path / "tp" / "checkpoints" / "step-3")
    adapters = str(tmp_path / "adapters")
    assert export.main([checkpoint, adapters]) == 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters)
    ours = _logits(export.load_model(checkpoint, export.run_config(checkpoint)))
    torch.testing.assert_close(_logits(peft_model), ours, rtol=0, atol=1e-5)


def test_without_adapters_is_the_pretrained_model_and_leaves_the_adapters_on(tmp_path):
    """recipe=dpo's reference under peft=lora: the policy with its adapters off, not a second copy."""
    from types import SimpleNamespace

    from trainer.models import lora

    base = make_llama(str(tmp_path))
    cfg = SimpleNamespace(name="lora", rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "down_proj"])
    model = lora.apply(from_hf(base), cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    adapted = _logits(model)
    assert (adapted - _logits(from_hf(base))).abs().max() > 1e-3
    with torch.no_grad():
        reference = lora.without_adapters(model.eval())(TOKENS)
    torch.testing.assert_close(reference, _logits(from_hf(base)), rtol=0, atol=1e-6)
    torch.testing.assert_close(_logits(model), adapted, rtol=0, atol=0)  # on again


def test_a_lora_run_says_its_trainable_parameters_as_peft_does(lora_run):
    """The line at the start of a LoRA run is PEFT's print_trainable_parameters of the same adapters on the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base, _, run_dir = lora_run
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS.strip("[]").split(",")))
    trainable, total = peft_model.get_nb_trainable_parameters()
    line = f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}"
    with open(os.path.join(run_dir, "logs", "rank-0.log")) as f:
        assert line in f.read()


def test_an_adapter_directory_as_model_path_is_refused_with_the_command_that_merges_it(lora_run, tmp_path, capsys):
    """PEFT's adapters (`python -m trainer.export` writes them as PEFT does) given as model.path: one line naming
    the merge; that command, run as printed, makes a model directory model=hf reads."""
    import subprocess
    import sys

    from trainer.config import hf

    base, checkpoint, _ = lora_run
    adapters = str(tmp_path / "adapters")
    assert export.main([checkpoint, adapters]) == 0
    err = compose_refused(tmp_path, capsys, "model=hf", f"model.path={adapters}")
    assert err.count("\n") <= 1 and "holds PEFT adapters (adapter_config.json), not a whole model" in err
    command = err.split("`")[1]
    assert command == hf.merge_command(adapters, base)
    proc = subprocess.run(command.replace("python ", f"{sys.executable} ", 1), shell=True, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"model.path={adapters}-merged" in err and hf.read_config(f"{adapters}-merged")["architectures"] == [
        "LlamaForCausalLM"]


def test_a_gguf_file_or_a_folder_without_config_json_is_refused_saying_what_is_expected(tmp_path, capsys):
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    err = compose_refused(tmp_path, capsys, "model=hf", f"model.path={gguf}")
    assert "is a GGUF file (llama.cpp's format), which trainjob does not load: give a Hugging Face model" in err
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    err = compose_refused(tmp_path, capsys, "model=hf", f"model.path={tmp_path / 'weights'}")
    assert "holds no config.json (model.safetensors): give a Hugging Face model directory (config.json and" in err
