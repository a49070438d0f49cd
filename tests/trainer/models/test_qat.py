"""`train.qat=int8_dynamic_act_int4_weight` (torchao): a model trained fake-quantised keeps its loss once its weights
are int4, where post-training quantisation of the same starting model loses more; a QAT run under FSDP2 (2 real
ranks) exports with `python -m trainer.export --quantize` to fp weights plus torchao's converted form, which loads
and computes what quantising the fp weights computes; what QAT cannot run with is refused in one line."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from tests.conftest import DIST, TINY, compose_refused
from trainer.models import hf, qat
from trainer.models.llama import Transformer

pytestmark = pytest.mark.timeout(300)
SCHEME, V, S = "int8_dynamic_act_int4_weight", 64, 16


def _rows(gen: torch.Generator, n: int) -> torch.Tensor:
    """Sequences of a fixed rule from a random start: a task a tiny model learns to near-zero loss, where the
    rounding of its weights shows."""
    steps = torch.arange(S + 1)
    return (torch.randint(0, V, (n, 1), generator=gen) * 5 + steps * 7 + (steps * steps) % 11) % V


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=V, max_seq_len=64,
                        rope_theta=1e4, norm_eps=1e-5, tie_embeddings=False)
    model.init_buffers()
    return model


def _train(model: torch.nn.Module, steps: int, lr: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        x = _rows(gen, 16)
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


def test_qat_keeps_the_loss_at_int4_better_than_post_training_quantisation():
    held_out = _rows(torch.Generator().manual_seed(123), 64)

    def loss(model):
        with torch.no_grad():
            return float(model(held_out[:, :-1], held_out[:, 1:]))

    start = _model()
    _train(start, 60, 1e-2, seed=1)
    ptq_gap = loss(qat.quantize(copy.deepcopy(start), SCHEME, 32)) - loss(start)
    trained = qat.prepare(copy.deepcopy(start), SCHEME, 32)
    _train(trained, 30, 1e-3, seed=2)
    plain = _model()
    plain.load_state_dict(trained.state_dict())  # the fake-quantised layers keep the plain names
    qat_gap = loss(qat.quantize(copy.deepcopy(plain), SCHEME, 32)) - loss(plain)
    assert ptq_gap > 0 and abs(qat_gap) < ptq_gap / 2, (qat_gap, ptq_gap)


@pytest.mark.e2e
def test_a_qat_run_under_fsdp2_exports_its_int4_form(run_cli, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*TINY, *DIST, "strategy=fsdp2", f"train.qat={SCHEME}", "train.max_steps=2", "train.eval_every=2",
                   "train.checkpoint_every=2", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    proc = run_cli(str(run / "checkpoints" / "step-2"), str(out), "--quantize", module="trainer.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "quantization.json", "quantized.pt"]
    assert json.loads((out / "quantization.json").read_text())["group_size"] == 32
    tokens = torch.randint(0, 259, (2, 17), generator=torch.Generator().manual_seed(0))
    fp = hf.from_hf(str(out))
    expected = qat.quantize(copy.deepcopy(fp), SCHEME, 32)(tokens)
    loaded = qat.load(str(out))
    assert type(loaded.layers["0"].attention.wq.weight).__name__ == "IntxUnpackedToInt8Tensor"
    torch.testing.assert_close(loaded(tokens), expected)
    assert (loaded(tokens) - fp(tokens)).abs().max() > 0  # it is quantised


def test_qat_that_cannot_run_is_refused(tmp_path, capsys):
    qat_on = f"train.qat={SCHEME}"
    assert "train.qat='int4': must be one of none, int8_dynamic_act_int4_weight" in compose_refused(
        tmp_path, capsys, *TINY, "train.qat=int4")
    assert "train.qat_group_size=48: must divide model.dim=64" in compose_refused(
        tmp_path, capsys, *TINY, qat_on, "train.qat_group_size=48")
    assert "splits them over tensor-parallel ranks: use strategy=ddp or fsdp2" in compose_refused(
        tmp_path, capsys, *TINY, qat_on, *DIST, "strategy=tp")
