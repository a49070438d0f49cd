"""`model.impl=transformers`: a causal LM we have not written (GPT-NeoX: fused q/k/v, parallel residual, partial
rotary; Cohere: tied embeddings and scaled logits) runs through transformers' own modeling code. Its logits are
transformers' own (packed rows and KV-cache decoding included), `python -m trainer model=hf model.path=DIR` chooses
it and says so, trains LoRA on module names of its own with packed conversations, resumes a one-process checkpoint
under fsdp2 on 2 processes with the same losses, and exports PEFT adapters and a merged model that peft and
transformers load with the run's logits; tp is refused where the model ships no plan; forced on a Llama directory
it trains with our decoder's losses."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import DIST, cli, compose_refused, compose_run, read_metrics
from tests.trainer.hf_models import SHAPE, _perturbed, add_tokenizer, make_llama
from tests.trainer.recipes.test_sft import _chats
from trainer import export
from trainer.generate import generate
from trainer.models import hf_transformers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TOKENS = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
DOCUMENTS = torch.tensor([[0] * 10 + [1] * 14, [0] * 5 + [1] * 7 + [2] * 12])


def make(root, name: str) -> str:
    """A tiny random model of a family trainjob does not write, saved by transformers."""
    import transformers

    torch.manual_seed(0)
    config_class, model_class, extra = {
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
        "cohere": ("CohereConfig", "CohereForCausalLM", {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}),
        "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    }[name]
    config = getattr(transformers, config_class)(**SHAPE, **extra)
    path = os.path.join(str(root), name)
    _perturbed(getattr(transformers, model_class)(config)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-transformers")
    return {"neox": add_tokenizer(make(root, "gpt_neox")), "cohere": make(root, "cohere"),
            "stablelm": make(root, "stablelm"), "llama": make_llama(str(root)), "root": root}


def _reference(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("family", ["neox", "cohere"])
def test_logits_packed_rows_and_decoding_are_transformers_own(dirs, family):
    ours, ref = hf_transformers.from_hf(dirs[family]).eval(), _reference(dirs[family])
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), ref(TOKENS).logits, rtol=0, atol=1e-5)
        packed = ours(TOKENS, documents=DOCUMENTS)
        for row in range(2):  # each packed document as if it were alone
            for doc in DOCUMENTS[row].unique():
                alone = ref(TOKENS[row : row + 1, DOCUMENTS[row] == doc]).logits[0]
                torch.testing.assert_close(packed[row, DOCUMENTS[row] == doc], alone, rtol=0, atol=1e-5)
        prompts = [[5, 6, 7, 8, 9], [11, 12]]  # left padded together in our KV cache
        theirs = [ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p) :].tolist() for p in prompts]
    assert generate(ours, prompts, 6) == theirs
    # The loss inside forward is the cross-entropy of transformers' logits.
    targets = torch.roll(TOKENS, -1, 1)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(ref(TOKENS).logits.flatten(0, 1), targets.flatten())
        assert ours(TOKENS, targets).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.fixture(scope="module")
def lora_run(dirs, cache_dir):
    """SFT with LoRA on GPT-NeoX's own module names, packed conversations, 4 steps in one process."""
    root = dirs["root"]
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _chats(48, seed=1)))
    args = ["model=hf", f"model.path={dirs['neox']}", "recipe=sft", "data=chat", f"data.path={chats}",
            "data.seq_len=48", "data.eval_percent=25", "train.global_batch_size=4",
            "train.max_steps=4", "train.eval_every=4", "train.checkpoint_every=2", "train.progress=false",
            "train.log_every=1", "lr_schedule.warmup_steps=1", "optim.lr=0.01", "peft=lora", "peft.rank=4",
            "peft.target_modules=[query_key_value,dense]"]
    run_dir = root / "lora"
    proc = cli(cache_dir, root, *args, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return args, run_dir


def test_an_architecture_we_have_not_written_is_chosen_for_transformers_and_trains(lora_run):
    _, run_dir = lora_run
    with open(run_dir / "logs" / "rank-0.log") as f:
        log = f.read()
    assert ("model.impl=transformers (chosen from config.json): GPTNeoXForCausalLM runs through transformers' own "
            "modeling code (GPTNeoXForCausalLM is not native)") in log
    losses = [m["loss"] for m in read_metrics(str(run_dir))]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.e2e
def test_a_one_process_checkpoint_resumes_under_fsdp2_with_the_same_losses(lora_run, cache_dir, tmp_path):
    args, ref_dir = lora_run
    run_dir = tmp_path / "fsdp2"
    proc = cli(cache_dir, tmp_path, *args, *DIST, "strategy=fsdp2",
               f"train.resume={ref_dir / 'checkpoints' / 'step-2'}", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, ref = read_metrics(str(run_dir)), read_metrics(str(ref_dir))
    assert [m["step"] for m in ours] == [3, 4]
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in ref[2:]], rel=1e-4)


def test_lora_export_loads_in_peft_and_merged_in_transformers_with_the_runs_logits(lora_run, dirs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run_dir = lora_run
    checkpoint = str(run_dir / "checkpoints" / "step-4")
    with torch.no_grad():
        ours = export.load_model(checkpoint, export.run_config(checkpoint)).eval()(TOKENS)
    adapters, merged = str(tmp_path / "adapters"), str(tmp_path / "merged")
    assert export.main([checkpoint, adapters]) == 0 and export.main([checkpoint, merged, "--merge"]) == 0
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        assert json.load(f)["target_modules"] == ["query_key_value", "dense"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dirs["neox"]), adapters).eval()
    with torch.no_grad():
        assert not torch.allclose(ours, _reference(dirs["neox"])(TOKENS).logits, atol=1e-3)  # the adapters count
        torch.testing.assert_close(peft_model(TOKENS).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(merged).eval()(TOKENS).logits, ours,
                                   rtol=0, atol=1e-5)
    with open(os.path.join(merged, "config.json")) as f:
        assert json.load(f)["architectures"] == ["GPTNeoXForCausalLM"]


def test_tp_where_the_model_ships_no_plan_and_architectures_transformers_lacks_are_refused(dirs, tmp_path, capsys):
    err = compose_refused(tmp_path, capsys, "model=hf", f"model.path={dirs['stablelm']}", "strategy=tp", *DIST)
    assert err.count("\n") == 1
    assert (f"strategy='tp': strategy=tp splits layers by a tensor-parallel plan; model.impl=transformers takes "
            f"the one its config class ships (base_model_tp_plan), and {dirs['stablelm']}'s has none") in err
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    for name in os.listdir(dirs["stablelm"]):
        (unknown / name).write_bytes((dirs["root"] / "stablelm" / name).read_bytes())
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    err = compose_refused(tmp_path, capsys, "model=hf", f"model.path={unknown}")
    assert "its architecture NoSuchForCausalLM is not a causal LM transformers" in err and err.count("\n") == 1
    err = compose_refused(tmp_path, capsys, "model=hf", f"model.path={dirs['neox']}", "model.impl=native")
    assert "GPTNeoXForCausalLM is not supported" in err and "model.impl=transformers runs it" in err
    # A plan, but an output layer tied to the embedding, which the plan splits by rows: refused by the driver.
    tied = tmp_path / "tied"
    tied.mkdir()
    for name in os.listdir(dirs["neox"]):
        (tied / name).write_bytes((dirs["root"] / "gpt_neox" / name).read_bytes())
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    err = compose_refused(tmp_path, capsys, "model=hf", f"model.path={tied}", "strategy=tp", *DIST)
    assert f"model.path={tied} ties its output layer to its embedding (tie_word_embeddings)" in err, err
    assert err.count("\n") == 1


def test_forced_on_a_llama_directory_it_trains_with_our_decoders_losses(dirs, cache_dir, tmp_path):
    losses = {}
    for impl in ("native", "transformers"):
        run = compose_run(tmp_path / impl, "model=hf", f"model.path={dirs['llama']}", f"model.impl={impl}",
                          "data.seq_len=32", "train.global_batch_size=4", "train.max_steps=2", "train.eval_every=2",
                          "train.progress=false", "train.log_every=1", f"data.cache_dir={cache_dir}")
        run.launcher_for().launch(run.spec).result()
        losses[impl] = [m["loss"] for m in read_metrics(str(tmp_path / impl / "run"))]
    assert len(losses["native"]) == 2
    assert losses["transformers"] == pytest.approx(losses["native"], rel=1e-5)


def test_kernels_triton_routes_aten_ops_for_the_step_with_the_same_loss_and_gradients(dirs):
    from types import SimpleNamespace

    from ops import aten
    from trainer.models.kernels import Kernels

    tokens = TOKENS[:1, :9]
    plain, routed = hf_transformers.from_hf(dirs["neox"]), hf_transformers.from_hf(dirs["neox"])
    section = SimpleNamespace(name="triton", include=None, exclude=[], aten=True)
    switch = Kernels.of(section)
    switch.apply(routed)
    assert routed.fused_loss_fn is not None  # the loss fused with the output layer: no logits
    expected = plain(tokens[:, :-1], tokens[:, 1:])
    expected.backward()
    aten.calls.clear()
    with switch.routing():  # what the training loop runs each step under
        loss = routed(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    assert aten.calls["mm"] > 0 and aten.calls["addmm"] > 0 and aten.registered() == []  # scoped to the step
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for ours, theirs in zip(routed.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_decodes_through_the_kv_cache(tmp_path, family):
    """transformers' MoE models with `output_router_logits` (their router loss in training) generate through our
    KV cache, left-padded prompts included, the tokens our native decoder generates (GRPO's rollout under
    model.impl=transformers)."""
    from tests.trainer.hf_models import make_family
    from trainer.models import from_hf

    path = make_family(str(tmp_path), family)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    ours = hf_transformers.from_hf(path).eval()
    assert ours.causal_lm.config.output_router_logits
    assert generate(ours, prompts, 6) == generate(from_hf(path).eval(), prompts, 6)
