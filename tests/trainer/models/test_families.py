"""The native families (`trainer.config.families`): a tiny model of each, built by transformers from the family's own
config class with every tensor perturbed, gives transformers' logits (eager attention, fp32), its loss's
gradient reaches every parameter, and what transformers' config.json says is read as the `model` keys."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import read_metrics
from tests.trainer.hf_models import FAMILIES, add_tokenizer, make_family
from trainer.config.hf import settings
from trainer.models import from_hf

pytestmark = pytest.mark.timeout(300)
NAMES = sorted(FAMILIES)
# Longer than the sliding windows (8), so that windowed layers differ from full ones.
TOKENS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("families"))
    return {name: add_tokenizer(make_family(root, name)) for name in NAMES}


def _transformers_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name", NAMES)
def test_each_family_gives_the_logits_of_transformers(family_dirs, name):
    model = from_hf(family_dirs[name]).eval()
    with torch.no_grad():
        ours = model(TOKENS)
    torch.testing.assert_close(ours, _transformers_logits(family_dirs[name], TOKENS), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_the_losss_gradient_reaches_every_parameter(family_dirs, name):
    model = from_hf(family_dirs[name])
    model(TOKENS[:, :-1], TOKENS[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_config_json_is_read_as_the_family_options(family_dirs):
    gemma2, gemma3 = settings(family_dirs["gemma2"]), settings(family_dirs["gemma3"])
    assert (gemma2["family"], gemma2["norm_placement"], gemma2["norm_offset"], gemma2["activation"]) == (
        "gemma2", "sandwich", 1.0, "gelu_tanh")
    assert gemma2["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (gemma2["attn_softcap"], gemma2["final_softcap"], gemma2["attention_scale"]) == (5.0, 3.0, 20**-0.5)
    assert gemma2["embedding_multiplier"] == 8.0 and gemma2["tie_embeddings"]
    assert (gemma3["rope_theta"], gemma3["rope_local_theta"], gemma3["qk_norm"]) == (100000.0, 1000.0, "head")
    assert settings(family_dirs["qwen3"])["head_dim"] == 24
    assert settings(family_dirs["smollm3"])["nope_layers"] == [1]
    assert settings(family_dirs["phi3"])["layer_types"] == ["sliding_attention"] * 2  # its window is every layer's
    assert settings(family_dirs["olmo2"])["qk_norm"] == "full"
    granite = settings(family_dirs["granite"])
    assert (granite["embedding_multiplier"], granite["residual_multiplier"], granite["attention_scale"],
            granite["logits_scaling"]) == (3.0, 0.5, 0.1, 4.0)
    moe = settings(family_dirs["qwen3_moe"])
    assert (moe["n_experts"], moe["n_experts_per_token"], moe["moe_ffn_dim"], moe["norm_topk_prob"]) == (4, 2, 32, True)
    assert settings(family_dirs["mixtral"])["norm_topk_prob"] is True


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_router_loss_is_transformers_aux_loss(family_dirs, name):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(family_dirs[name], dtype=torch.float32).eval()
    ours = from_hf(family_dirs[name]).eval()
    coef = FAMILIES[name][2]["router_aux_loss_coef"]
    with torch.no_grad():
        out = theirs(TOKENS, labels=TOKENS)  # the router sees all 24 tokens, the loss predicts 23
        ours(TOKENS, TOKENS)
        torch.testing.assert_close(ours.moe_stats["moe/aux_loss"], out.aux_loss, rtol=1e-5, atol=1e-6)
        loss = ours(TOKENS[:, :-1], TOKENS[:, 1:])
    # Ours adds coef x its aux loss over its 23 tokens to the cross-entropy, as transformers does over its 24.
    torch.testing.assert_close(loss - coef * ours.moe_stats["moe/aux_loss"], out.loss - coef * out.aux_loss,
                               rtol=1e-5, atol=1e-6)
    assert ours.moe_stats["moe/expert_load_max"] >= 1.0


STEPS = ["train.max_steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.progress=false",
         "train.log_every=1", "data.seq_len=24", "train.global_batch_size=4", "optim.lr=1e-2"]


def _preset_runs(family_dirs, root) -> list:
    """Two steps of the Qwen3 GRPO preset on text prompts and of the Gemma 3 LoRA preset on conversations."""
    import json
    import random

    from tests.trainer.recipes.test_sft import _chats

    rng = random.Random(0)
    prompts, chats = root / "prompts.jsonl", root / "chats.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(["the", "cat", "sat"]) for _ in range(3))})
                               + "\n" for _ in range(32)))
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _chats(32, seed=1)))
    small = ["train.max_steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.progress=false",
             "train.log_every=1", "data.seq_len=32", "lr_schedule.warmup_steps=0", "strategy=ddp"]
    return [
        (["+experiment=qwen3_0_6b_grpo", f"model.path={family_dirs['qwen3']}", f"data.path={prompts}", *small,
          "recipe.num_generations=4", "train.global_batch_size=8", "recipe.max_completion_length=8",
          "data.eval_percent=25", "recipe.reward_funcs=[tests.trainer.grpo_rewards:lowercase]",
          f"hydra.run.dir={root / 'grpo'}"], root),
        (["+experiment=gemma3_1b_lora", f"model.path={family_dirs['gemma3']}", f"data.path={chats}", *small,
          "train.global_batch_size=4", "data.eval_percent=25", f"hydra.run.dir={root / 'gemma3-lora'}"], root),
    ]


@pytest.mark.e2e
@pytest.mark.timeout(900)  # eleven short runs: about a minute of CPU, more on a busy machine
def test_each_family_trains_and_exports_to_what_transformers_loads(family_dirs, run_cli_batch, tmp_path):
    """`python -m trainer model=hf model.path=DIR` trains each family two steps (one interpreter forking a run per
    family); `python -m trainer.export` writes a directory transformers loads with the trained model's logits.
    The Qwen3 GRPO and Gemma 3 LoRA presets train two steps on their families' tiny models."""
    from transformers import AutoModelForCausalLM

    from trainer import export

    runs = [(["model=hf", f"model.path={family_dirs[name]}", *STEPS, f"hydra.run.dir={tmp_path / name}"], tmp_path)
            for name in NAMES]
    runs += _preset_runs(family_dirs, tmp_path)
    procs = run_cli_batch(runs, timeout=900)
    for proc in procs[len(NAMES):]:  # the presets' runs
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reward" in read_metrics(str(tmp_path / "grpo"))[-1] and read_metrics(str(tmp_path / "gemma3-lora"))
    for name, proc in zip(NAMES, procs, strict=False):
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        checkpoint = str(tmp_path / name / "checkpoints" / "step-2")
        out = export.export(checkpoint, str(tmp_path / f"{name}-export"))
        ours = export.load_model(checkpoint, export.run_config(checkpoint)).eval()
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = ours(TOKENS)
            torch.testing.assert_close(theirs(TOKENS).logits, logits, rtol=0, atol=1e-4, msg=name)
            assert (logits - from_hf(family_dirs[name])(TOKENS)).abs().max() > 1e-3, name  # training moved it
        if FAMILIES[name][2].get("num_experts") or FAMILIES[name][2].get("num_local_experts"):
            line = read_metrics(str(tmp_path / name))[-1]
            assert line["moe/aux_loss"] > 0 and line["moe/expert_load_max"] >= 1.0, name


@pytest.mark.parametrize("name", ["gemma3", "granite"])
def test_triton_kernels_give_the_families_logits(family_dirs, name):
    """kernels=triton on Gemma 3 ((1 + w) norms, per-head q/k norms, GeLU-tanh gates, sliding and full layers)
    and Granite (the attention multiplier as the kernel's scale): the same logits and loss as PyTorch's."""
    from omegaconf import OmegaConf

    from trainer.models import kernels

    reference = from_hf(family_dirs[name]).eval()
    switch = kernels.Kernels.of(OmegaConf.create({"name": "triton", "include": None, "exclude": None}))
    model = switch.apply(from_hf(family_dirs[name]).eval())
    attention = model.layers["1"].attention
    assert attention.attention_fn is kernels.attention and model.fused_loss_fn is not None
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference(TOKENS), rtol=0, atol=1e-4)
        torch.testing.assert_close(model(TOKENS[:, :-1], TOKENS[:, 1:]), reference(TOKENS[:, :-1], TOKENS[:, 1:]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.e2e
def test_ddp_fsdp2_and_tp_on_two_processes_equal_one_for_every_family(family_dirs, tmp_path):
    """One torchrun of 2 gloo ranks (tests/trainer/family_ranks.py) places every family under ddp, fsdp2 (Phi-3's
    fused tensors split into sharded pieces, the experts sharded with their block) and tp (q/k norms per head or
    gathered over the projection, norms after attention and MLP, the router whole and each expert split): the
    same batch gives one process's loss and every parameter's gradient."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "tests.trainer.family_ranks", str(tmp_path), "ddp,fsdp2,tp",
                           *(family_dirs[name] for name in NAMES)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    for strategy in ("ddp", "fsdp2", "tp"):
        assert sorted(results[strategy]) == NAMES
        for name, r in results[strategy].items():
            assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5), (strategy, name)
            assert r["worst_grad_error"] < 1e-4, (strategy, name)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_through_the_kv_cache_gives_the_full_forwards_logits(family_dirs, name):
    """A prompt of 5 tokens, then 19 more one at a time: past the sliding window (8) of Gemma's local layers,
    whose cached keys beyond it must drop out, and through soft-capping, layers without RoPE and the experts."""
    from trainer.models.kv_cache import KVCache

    model = from_hf(family_dirs[name]).eval()
    cache = KVCache(len(model.layers), TOKENS.shape[1])
    steps = [TOKENS[:, :5]] + [TOKENS[:, i : i + 1] for i in range(5, TOKENS.shape[1])]
    with torch.no_grad():
        full = model(TOKENS)
        cached = []
        for step in steps:
            cache.append(torch.ones_like(step, dtype=torch.bool))
            cached.append(model(step, cache=cache))
    torch.testing.assert_close(torch.cat(cached, dim=1), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen3_moe"])
def test_greedy_generation_equals_transformers_generate(family_dirs, name):
    from transformers import AutoModelForCausalLM

    from trainer.generate import generate

    prompts = TOKENS[:, :6]
    theirs = AutoModelForCausalLM.from_pretrained(family_dirs[name], dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    out = theirs.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(from_hf(family_dirs[name]), prompts.tolist(), 16) == out[:, 6:].tolist()


@pytest.mark.parametrize("name", ["phi3", "gemma2", "olmo2", "qwen3_moe"])
def test_lora_adapters_on_the_familys_names_load_in_peft_with_our_logits(family_dirs, name, tmp_path):
    """Adapters on every projection the family names (Phi-3: the fused qkv_proj and gate_up_proj, written as
    PEFT's one adapter of the fused layer; a mixture of experts: the attention's), with random A and B, export
    as PEFT saves them, and `PeftModel.from_pretrained` on transformers' model gives our logits."""
    from omegaconf import OmegaConf
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer import export
    from trainer.config.families import BY_NAME
    from trainer.models import lora

    targets = list(BY_NAME[name].lora_targets)
    peft_cfg = OmegaConf.create({"name": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": targets})
    model = lora.apply(from_hf(family_dirs[name]), peft_cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if lora.is_adapter(n):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    cfg = OmegaConf.create({"model": {"name": "hf", "path": family_dirs[name]}, "peft": peft_cfg})
    out = str(tmp_path / "adapters")
    export.write(model, cfg, out)
    base = AutoModelForCausalLM.from_pretrained(family_dirs[name], dtype=torch.float32, attn_implementation="eager")
    theirs = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        ours = model.eval()(TOKENS)
        assert (ours - from_hf(family_dirs[name])(TOKENS)).abs().max() > 1e-2  # the adapters count
        torch.testing.assert_close(theirs(TOKENS).logits, ours, rtol=0, atol=1e-4)


def _respelled(src: str, dst: str, drop: tuple[str, ...], **changes) -> str:
    """A copy of model directory `src` whose config.json drops `drop` and sets `changes`."""
    import json
    import shutil

    shutil.copytree(src, dst)
    with open(f"{dst}/config.json") as f:
        config = json.load(f)
    for key in drop:
        config.pop(key, None)
    config.update(changes)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(config, f)
    return dst


def test_dense_layers_among_experts_load_and_export_under_their_own_names(tmp_path):
    """Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step` make some layers dense MLPs (`mlp.gate_proj`, ...):
    they load with transformers' logits, and our weights written back under the checkpoint's names give them."""
    import transformers
    from safetensors.torch import save_file

    from tests.trainer.hf_models import FAMILY_SHAPE, _perturbed
    from trainer.models.hf import family_of, hf_state

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**FAMILY_SHAPE, **FAMILIES["qwen3_moe"][2], "num_hidden_layers": 4,
                                            "mlp_only_layers": [0], "decoder_sparse_step": 2})
    path = str(tmp_path / "mixed")
    _perturbed(transformers.Qwen3MoeForCausalLM(config)).save_pretrained(path)
    ours = from_hf(path).eval()
    assert [type(b.feed_forward).__name__ for b in ours.layers.values()] == ["FeedForward", "MoE", "FeedForward",
                                                                             "MoE"]
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), _transformers_logits(path, TOKENS), rtol=0, atol=1e-4)
        state = hf_state({n: p.clone() for n, p in ours.named_parameters()}, family_of(ours))
    assert "model.layers.0.mlp.gate_proj.weight" in state and "model.layers.1.mlp.gate.weight" in state
    save_file(state, f"{path}/model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(_transformers_logits(path, TOKENS), ours(TOKENS), rtol=0, atol=1e-4)


def test_transformers_4_spellings_of_config_json_read_the_same(family_dirs, tmp_path):
    """Gemma 3 as transformers 4 wrote it (rope_theta, rope_local_base_freq, sliding_window_pattern, a linear
    rope_scaling of its global layers) and Qwen3-MoE's num_experts: the same model keys, and transformers' logits."""
    gemma3 = _respelled(family_dirs["gemma3"], str(tmp_path / "gemma3"), ("rope_parameters", "layer_types"),
                        rope_theta=100000.0, rope_local_base_freq=1000.0, sliding_window_pattern=2,
                        rope_scaling={"rope_type": "linear", "factor": 4.0})
    read = settings(gemma3)
    assert {k: read[k] for k in ("rope_theta", "rope_local_theta", "layer_types", "sliding_window")} == {
        k: settings(family_dirs["gemma3"])[k] for k in ("rope_theta", "rope_local_theta", "layer_types",
                                                         "sliding_window")}
    with torch.no_grad():
        torch.testing.assert_close(from_hf(gemma3).eval()(TOKENS), _transformers_logits(gemma3, TOKENS), rtol=0,
                                   atol=1e-4)
    moe = _respelled(family_dirs["qwen3_moe"], str(tmp_path / "moe"), ("num_local_experts",), num_experts=4)
    assert settings(moe)["n_experts"] == 4


def test_what_a_family_cannot_take_is_refused_in_one_line(family_dirs, tmp_path, capsys):
    from tests.conftest import compose_refused

    phi3 = family_dirs["phi3"]
    message = compose_refused(tmp_path, capsys, "model=hf", f"model.path={phi3}", "peft=lora")
    assert "peft.target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']: a phi3 model has" in message
    assert "qkv_proj" in message and "gate_up_proj" in message
    message = compose_refused(tmp_path, capsys, "model=hf", f"model.path={family_dirs['qwen3_moe']}", "peft=lora",
                              "peft.target_modules=[q_proj,gate_proj]")
    assert "a qwen3_moe model has q_proj, k_proj, v_proj, o_proj" in message
    message = compose_refused(tmp_path, capsys, "model=hf", f"model.path={family_dirs['gemma2']}", "recipe=kd",
                              "data=chat", "data.path=x.jsonl", f"recipe.teacher.path={family_dirs['gemma2']}")
    assert "recipe='kd': distils" in message and "model.final_softcap=3.0" in message
    partial = _respelled(family_dirs["phi3"], str(tmp_path / "phi4-mini"), ("rope_parameters",), rope_theta=1e4,
                         partial_rotary_factor=0.75)  # as transformers 4 wrote Phi-4-mini
    with pytest.raises(Exception, match="partial_rotary_factor below 1"):
        settings(partial)


@pytest.mark.slow
@pytest.mark.e2e
def test_what_only_a_rank_finds_is_reported_once_by_the_driver_with_exit_2(family_dirs, run_cli, tmp_path):
    """Weights that do not fit the shapes config.json gives are found by the ranks as they load them (the driver
    reads no tensor): under torchrun the driver prints the lowest rank's one line, not "see its logs", and
    exits 2 as the rank did."""
    bad = _respelled(family_dirs["qwen3_moe"], str(tmp_path / "bad"), (), moe_intermediate_size=48)
    proc = run_cli("model=hf", f"model.path={bad}", "+runtime=torch-distributed", "runtime.nproc_per_node=2",
                   "train.max_steps=1", "data.seq_len=24", "train.global_batch_size=4",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: invalid config: model.path='{bad}': its weights hold (32, 64) for "
                      "model.layers.0.mlp.experts.0.gate_proj.weight, the model its config.json describes needs "
                      "shape (48, 64)"], proc.stderr[-3000:]
    assert "see its logs" not in proc.stderr
