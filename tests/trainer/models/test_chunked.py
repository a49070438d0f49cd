"""`trainer.models.chunked`: log-probabilities and the cross-entropy made a chunk of tokens at a time equal the
whole logits' (values and gradients, 1e-5 in float32) for any chunk size and mask; the model's loss (pretrain,
sft under kernels=torch) is the whole logits' cross-entropy; under kernels=triton the chunks' log-softmax is the
Triton cross-entropy. Under tensor parallelism (vocabulary-split logits) recipe=ppo's log-probabilities and entropy
on two gloo ranks equal the unsharded function's, and the recipes' runs equal one process's:
tests/trainer/recipes/test_dpo.py and test_ppo.py (strategy=tp) and tests/trainer/parallel/test_strategies.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from trainer.models import chunked
from trainer.models.llama import Transformer

pytestmark = pytest.mark.timeout(300)


def _case(seed: int, batch: int, seq: int, dim: int, vocab: int, ignored: float):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets[torch.rand(batch, seq, generator=gen) < ignored] = chunked.IGNORE
    upstream = torch.randn(batch, seq, generator=gen)
    return hidden, weight, targets, upstream


def _whole_logps(hidden, weight, targets):
    logits = F.linear(hidden, weight).float()
    return -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


@settings(max_examples=examples(40), deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 20), vocab=st.integers(2, 300), chunk=st.integers(1, 40),
       ignored=st.sampled_from([0.0, 0.4, 1.0]), seed=st.integers(0, 2**16))
def test_token_logps_and_their_gradients_equal_the_whole_logits(batch, seq, vocab, chunk, ignored, seed):
    hidden, weight, targets, upstream = _case(seed, batch, seq, 16, vocab, ignored)
    got = chunked.token_logps(hidden, weight, targets, chunk_tokens=chunk)
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    expected = _whole_logps(hidden, weight, targets)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert (got[targets == chunked.IGNORE] == 0).all()


def test_the_models_loss_is_the_whole_logits_cross_entropy():
    torch.manual_seed(0)
    model = Transformer(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97, max_seq_len=64,
                        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    model.init_buffers()
    tokens = torch.randint(0, 97, (3, 25))
    targets = tokens[:, 1:].masked_fill(torch.rand(3, 24) < 0.3, chunked.IGNORE)
    loss = model(tokens[:, :-1], targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(tokens[:, :-1])
    expected = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    # The loss_fn hook gives the recipes' log-probabilities from the same hidden states.
    logps = model(tokens[:, :-1], targets, loss_fn=chunked.token_logps)
    torch.testing.assert_close(-logps.sum() / (targets != chunked.IGNORE).sum(), expected, rtol=1e-5, atol=1e-6)


def test_a_fake_quantised_output_layer_is_chunked_as_it_computes_whole():
    """train.qat: the chunks multiply the hidden states and weight as torchao's FakeQuantizedLinear rounds them."""
    from trainer.models import qat

    torch.manual_seed(0)
    model = Transformer(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=64,
                        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    model.init_buffers()
    qat.prepare(model, "int8_dynamic_act_int4_weight", 32)
    tokens = torch.randint(0, 96, (2, 17))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    whole = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(loss, whole, rtol=1e-5, atol=1e-6)
    grad = torch.autograd.grad(loss, model.output.weight)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(whole, model.output.weight)[0], rtol=1e-4, atol=1e-6)


def test_chunks_are_sized_to_the_vocabulary():
    assert chunked.chunk_tokens_for(151_936) * 151_936 * 4 <= chunked.CHUNK_BYTES
    assert chunked.chunk_tokens_for(256) >= 1024


def test_under_kernels_triton_the_chunks_log_softmax_is_the_triton_cross_entropy(monkeypatch):
    import ops
    from trainer.config.kernels import KernelsConfig
    from trainer.models.kernels import Kernels

    calls = []
    monkeypatch.setattr(ops, "cross_entropy", lambda *a, **k: calls.append(1) or ops.losses.cross_entropy(*a, **k))
    fn = Kernels.of(KernelsConfig(name="triton")).token_logps
    hidden, weight, targets, upstream = _case(3, 2, 9, 16, 40, 0.3)
    got = fn(hidden, weight, targets, chunk_tokens=4)
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    expected = _whole_logps(hidden, weight, targets)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    assert calls  # the Triton op (under Triton's interpreter on a CPU) took the chunks
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert Kernels.of(KernelsConfig(name="torch")).token_logps is chunked.token_logps


def _sharded_rank(rank: int, world: int, store: str, case: tuple, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    hidden, weight, targets, upstream = case
    hidden = hidden.clone().requires_grad_()
    shard = distribute_tensor(weight, init_device_mesh("cpu", (world,)), [Shard(0)]).requires_grad_()
    logps, entropy = chunked.token_logps_entropy(hidden, shard, targets, 0.7, chunk_tokens=4, softcap=3.0)
    grad_h, grad_w = torch.autograd.grad((logps * upstream).sum(), (hidden, shard))
    dist.all_reduce(grad_h)  # each rank's partial sum, as DTensor adds them up under tensor parallelism
    torch.save((logps, entropy, grad_h, grad_w.full_tensor()), f"{out}.{rank}")
    dist.destroy_process_group()


def test_log_probabilities_and_entropy_from_a_vocabulary_split_over_two_ranks_are_the_whole_vocabularys(tmp_path):
    """recipe=ppo under tensor parallelism: the output matrix split by vocabulary rows over two gloo ranks (51 rows:
    26 and 25), the log-probabilities, the entropy and the gradients equal the unsharded function's (float64,
    temperature and soft-cap applied, some targets IGNORE, chunks of 4 tokens)."""
    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(51, 16, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 51, (2, 9), generator=gen)
    targets[0, :3] = chunked.IGNORE
    upstream = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    out = str(tmp_path / "out")
    mp.start_processes(_sharded_rank, args=(2, str(tmp_path / "store"), (hidden, weight, targets, upstream), out),
                       nprocs=2, join=True, start_method="fork")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logps, entropy = chunked.token_logps_entropy(h, w, targets, 0.7, chunk_tokens=4, softcap=3.0)
    expected = (logps, entropy, *torch.autograd.grad((logps * upstream).sum(), (h, w)))
    assert entropy.abs().sum() > 0
    for rank in range(2):
        for got, want in zip(torch.load(f"{out}.{rank}"), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
