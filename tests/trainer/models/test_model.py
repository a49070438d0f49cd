"""The Llama-style model: shapes, causality, rotary tables, and sharding-invariant initialisation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from trainer import models
from trainer.data import tokenizer
from trainer.models.llama import apply_rotary

CFG = OmegaConf.create({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96,
                        "vocab_size": 259, "max_seq_len": 64, "rope_theta": 10000.0, "norm_eps": 1e-5,
                        "tie_embeddings": False, "init_std": 0.02})


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed: int = 0, **overrides):
    cfg = OmegaConf.merge(CFG, overrides)
    with torch.device("meta"):
        model = models.build(cfg)
    shapes = models.param_shapes(model)
    model.to_empty(device="cpu")
    models.init_weights(model, shapes, seed, cfg.init_std, cfg.n_layers)
    return model


def test_forward_shape_and_causality():
    model = _model()
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 259)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    out = model(changed)
    torch.testing.assert_close(out[:, :10], logits[:, :10])
    assert not torch.allclose(out[:, 10:], logits[:, 10:])


def test_init_is_deterministic_per_seed_and_name():
    a, b, c = _model(0), _model(0), _model(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    assert torch.equal(a.norm.weight, torch.ones(64))
    std = a.layers["0"].attention.wq.weight.std().item()
    assert 0.015 < std < 0.025
    assert a.layers["0"].attention.wo.weight.std().item() < std / 1.5  # scaled by 1/sqrt(2 * n_layers)


def test_tied_embeddings_share_one_tensor():
    model = _model(tie_embeddings=True)
    assert model.output is None and model.output_weight is model.tok_embeddings.weight
    tokens = torch.randint(0, 256, (1, 4))
    torch.testing.assert_close(model(tokens), model.hidden_states(tokens) @ model.tok_embeddings.weight.T)
    assert models.num_params(model) == models.num_params(_model()) - 259 * 64


def test_rotary_matches_complex_rotation():
    seq, heads, dim = 8, 2, 16
    model = _model()
    cos, sin = model.rope_cos[:seq, :dim], model.rope_sin[:seq, :dim]
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    cos, sin = [t.double() for t in (torch.outer(torch.arange(seq, dtype=torch.float64), inv).cos(),
                                      torch.outer(torch.arange(seq, dtype=torch.float64), inv).sin())]
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    q = torch.randn(1, seq, heads, dim, dtype=torch.float64)
    out, _ = apply_rotary(q, q, cos, sin)
    z = torch.complex(q[..., : dim // 2], q[..., dim // 2:])
    angle = torch.outer(torch.arange(seq, dtype=torch.float64), inv)[None, :, None, :]
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(out, torch.cat((rotated.real, rotated.imag), -1))
    torch.testing.assert_close(model.rope_cos[:seq, :16].double(), cos, atol=1e-6, rtol=0)


def test_tokenizer_round_trip():
    text = "def f(x):\n    return 'π' * x\n"
    ids = tokenizer.encode(text, bos=True)
    assert ids[0] == tokenizer.BOS and ids[-1] == tokenizer.EOS and ids.max() < tokenizer.VOCAB_SIZE
    assert tokenizer.decode(ids) == text
