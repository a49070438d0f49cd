"""A CPU decode's oneDNN-packed weights (`trainer.generate.packed_weights`): inside the block the layers compute what
they compute outside it, from weights packed when the block starts (an attention's three projections and a
feed-forward's gate and up as one product each); afterwards, or after a failure, the layers are
as they were; what the packing does not fit (LoRA's layers, hooked layers' fusing, routed matrix products,
autocast, compiled blocks, too little memory) is left alone, and a call with autograd on gets the layers' own
products and gradients. That greedy rows stay transformers' with the packing on is test_generation's
`test_greedy_equals_transformers_generate_token_for_token`."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ops
from trainer import models
from trainer.config import ModelConfig
from trainer.generate import generate, packed_weights
from trainer.generate.packed_weights import packed_linears
from trainer.models.lora import LoRALinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a PyTorch built without oneDNN")
VOCAB = 320


def _model(tied: bool, seed: int = 3, bias: str = "none") -> models.Transformer:
    cfg = ModelConfig(name="debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=VOCAB,
                      max_seq_len=128, tie_embeddings=tied, attention_bias=bias, mlp_bias=bias == "all")
    with torch.device("meta"):
        model = models.build(cfg)
    model.to_empty(device="cpu")
    models.init_weights(model, models.param_shapes(model), seed=seed, std=0.2, n_layers=cfg.n_layers)
    return model.eval()


def _replaced(model: nn.Module) -> set[tuple[str, str]]:
    """(module, method) of each method the packing set on a module object."""
    return {(name, method) for name, m in model.named_modules() for method in ("forward", "projections", "gate_and_up")
            if method in vars(m)}


def _expected(model: nn.Module, tied: bool) -> set[tuple[str, str]]:
    """Each attention's projections and each feed-forward's gate and up as one product; the other layers each."""
    found = {("tied_output" if tied else "output", "forward")}
    for i in model.layers:
        found |= {(f"layers.{i}.attention", "projections"), (f"layers.{i}.attention.wo", "forward"),
                  (f"layers.{i}.feed_forward", "gate_and_up"), (f"layers.{i}.feed_forward.w2", "forward")}
    return found


@pytest.mark.parametrize("tied, bias", [(False, "none"), (True, "qkv"), (False, "all")])
def test_inside_the_block_every_layer_multiplies_by_packed_weights_and_computes_the_same(tied, bias):
    model = _model(tied, bias=bias)
    for p in model.parameters():  # biases away from init's zeros
        if p.dim() == 1:
            p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    tokens = torch.randint(0, VOCAB, (5, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain, plain_one = model(tokens), model(tokens[:1, -1:])
        with packed_linears(model, rows=5):
            assert _replaced(model) == _expected(model, tied)
            packed = model(tokens)
            one_row = model(tokens[:1, -1:])
    assert _replaced(model) == set()
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one_row, plain_one, rtol=1e-5, atol=1e-5)  # fewer rows than packed for


def test_the_layers_are_given_back_when_the_block_fails():
    model = _model(tied=True)
    with pytest.raises(RuntimeError, match="mid-decode"), packed_linears(model, rows=2):
        assert _replaced(model)
        raise RuntimeError("mid-decode")
    assert _replaced(model) == set()
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, VOCAB)


def _counted(monkeypatch) -> list[int]:
    """Counts the products that take the packed weights (one entry each)."""
    calls, fast = [], packed_weights._fast
    monkeypatch.setattr(packed_weights, "_fast", lambda x: fast(x) and (calls.append(1) or True))
    return calls


def test_a_policy_trained_between_two_calls_samples_from_its_new_weights(monkeypatch):
    model = _model(tied=False)
    prompts = [[5, 9, 11], [7], [3, 4, 5, 6, 7, 8]]
    calls = _counted(monkeypatch)
    before = generate(model, prompts, 12)
    # The prefill and 11 steps, each: per layer the fused q/k/v, wo, the fused gate/up and w2; the output layer.
    assert len(calls) == 12 * (2 * 4 + 1)
    with torch.no_grad():
        model.output.weight.copy_(_model(tied=False, seed=11).output.weight)
    after = generate(model, prompts, 12)
    monkeypatch.setattr(packed_weights, "_available_bytes", lambda: 0)  # no room: the layers' own products
    del calls[:]
    assert after == generate(model, prompts, 12)
    assert after != before and calls == []


def test_autocast_autograd_and_compiled_blocks_get_the_layers_own_products(monkeypatch):
    model = _model(tied=True)
    calls = _counted(monkeypatch)
    prompts = [[5, 9, 11], [7, 1]]
    with torch.autocast("cpu", torch.bfloat16):  # train.mixed_precision=bf16 on a CPU: a bfloat16 decode
        mixed = generate(model, prompts, 6)
        with packed_linears(model, rows=2):
            assert _replaced(model) == set()
    assert calls == []
    monkeypatch.setattr(packed_weights, "_available_bytes", lambda: 0)
    with torch.autocast("cpu", torch.bfloat16):
        assert mixed == generate(model, prompts, 6)
    monkeypatch.undo()

    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    model(tokens).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with packed_linears(model, rows=1):  # a forward with autograd on, inside the block: gradients as outside
        assert _replaced(model)
        model(tokens).square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)

    model.layers["0"].compile(backend="eager")  # strategy.compile: nothing set on the modules it would guard on
    with packed_linears(model, rows=1):
        assert _replaced(model) == set()


def test_what_the_packing_does_not_fit_is_left_as_it_is(monkeypatch, caplog):
    model = _model(tied=False)
    adapted = model.layers["0"].attention.wq
    adapted.__class__ = LoRALinear
    adapted.add_adapter(4, 8.0, 0.0)
    seen = []
    model.layers["1"].feed_forward.w3.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    tokens = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        plain = model(tokens)
        with packed_linears(model, rows=4):
            replaced = _replaced(model)
            packed = model(tokens)
    # LoRA's layer is left (its adapters' own plain layers and its attention's other two are packed each); a
    # hooked layer is not fused, and its hook still runs.
    assert replaced == _expected(model, tied=False) - {("layers.0.attention", "projections"),
                                                      ("layers.1.feed_forward", "gate_and_up")} | {
        ("layers.0.attention.wq.lora_A", "forward"), ("layers.0.attention.wq.lora_B", "forward"),
        ("layers.0.attention.wk", "forward"), ("layers.0.attention.wv", "forward"),
        ("layers.1.feed_forward.w1", "forward"), ("layers.1.feed_forward.w3", "forward")}
    assert seen == [(1, 3, 128), (1, 3, 128)]
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)

    with ops.use_kernels(["mm"]), packed_linears(model, rows=4):  # products routed to our kernels stay theirs
        assert _replaced(model) == set()
    with packed_linears(model.to(torch.bfloat16), rows=4):  # another dtype's rounding would differ
        assert _replaced(model) == set()
    monkeypatch.setattr(packed_weights, "_available_bytes", lambda: 4 * sum(
        p.nbytes for n, p in model.named_parameters() if n.endswith("weight")) // 3)
    monkeypatch.setattr(packed_weights, "_SAID", [])
    with caplog.at_level(logging.INFO, logger=packed_weights.__name__):
        for _ in range(2):
            with packed_linears(model.float(), rows=4):  # a packed copy over a quarter of the memory available
                assert _replaced(model) == set()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["decoding with the layers' own weights"]
