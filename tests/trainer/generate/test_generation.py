"""Generation (`trainer.generate`): the KV cache gives the full forward's logits, greedy decoding of left-padded
batches gives `transformers`' `generate` token for token (under model.impl=transformers too, whose rows that
end leave transformers' own cache), and sampling keeps to its top-k and top-p tokens
(checked against transformers' logits warpers and by the definition).

The models are tiny random Hugging Face ones built with `transformers` (nothing is downloaded) and a preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, examples
from tests.trainer.hf_models import make_llama, make_mistral, make_qwen2
from trainer import models
from trainer.config import ModelConfig
from trainer.generate import generate, left_padded, sampling
from trainer.models import from_hf, hf_transformers
from trainer.models.kv_cache import KVCache

pytestmark = pytest.mark.timeout(300)
VOCAB = 320


def _preset() -> models.Transformer:
    cfg = ModelConfig(name="debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=VOCAB,
                      max_seq_len=128)
    with torch.device("meta"):
        model = models.build(cfg)
    model.to_empty(device="cpu")
    models.init_weights(model, models.param_shapes(model), seed=3, std=0.2, n_layers=cfg.n_layers)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    return {"llama": make_llama(root), "qwen2": make_qwen2(root), "llama-tied": make_llama(root, tie=True),
            "mistral": make_mistral(root)}


@pytest.fixture(scope="module")
def ours(hf_dirs):
    loaded = {name: from_hf(path).eval() for name, path in hf_dirs.items()}
    return {**loaded, "preset": _preset()}


def _cached_logits(model, rows: list[list[int]], prefill: int) -> list[torch.Tensor]:
    """Each row's logits at every one of its tokens, fed left padded: the first `prefill` columns of the padded
    batch in one call, then one column per call, all through one KVCache."""
    tokens, valid = left_padded(rows, pad=0)
    cache = KVCache(len(model.layers), tokens.shape[1])
    chunks = []
    with torch.no_grad():
        for start, end in [(0, prefill)] + [(i, i + 1) for i in range(prefill, tokens.shape[1])]:
            cache.append(valid[:, start:end])
            chunks.append(model(tokens[:, start:end], cache=cache))
    logits = torch.cat(chunks, dim=1)
    return [logits[i, tokens.shape[1] - len(row) :] for i, row in enumerate(rows)]


@settings(max_examples=examples(12))
@given(name=st.sampled_from(["preset", "qwen2", "llama"]),
       lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), prefill=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_kv_cache_logits_equal_the_full_forward(ours, name, lengths, prefill, seed):
    model = ours[name]
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    cached = _cached_logits(model, rows, min(prefill, max(lengths)))
    for row, logits in zip(rows, cached, strict=True):
        with torch.no_grad():
            full = model(torch.tensor([row]))[0]
        # fp32 sums in another order (a query over the cache, not the whole row): a few 1e-5 apart at most.
        torch.testing.assert_close(logits, full, rtol=0, atol=3e-5)


def _hf_greedy(path: str, prompts, max_new_tokens: int, eos: list[int], pad: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, valid = left_padded(prompts, pad)
    out = model.generate(input_ids=tokens, attention_mask=valid.long(), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos or None, pad_token_id=pad)
    return out[:, tokens.shape[1] :].tolist()


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-tied", "mistral"])
def test_greedy_equals_transformers_generate_token_for_token(hf_dirs, ours, name):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 13, 1, 8)]
    # An end token that the second row writes midway: that row stops there, the others may run on.
    free = generate(ours[name], prompts, 24)
    eos = [free[1][5]]
    mine = generate(ours[name], prompts, 24, eos=eos, pad=0)
    theirs = _hf_greedy(hf_dirs[name], prompts, 24, eos, pad=0)
    assert len(mine[1]) <= 6 and mine[1][-1] == eos[0]
    for row, reference in zip(mine, theirs, strict=True):
        # transformers pads a row that has ended until every row has.
        assert reference == row + [0] * (len(reference) - len(row))
    assert free == _hf_greedy(hf_dirs[name], prompts, 24, [], pad=0)


def _hf_sampled(path: str, prompts, max_new_tokens: int, eos: list[int], seed: int, **warpers) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, valid = left_padded(prompts, 0)
    torch.manual_seed(seed)
    out = model.generate(input_ids=tokens, attention_mask=valid.long(), max_new_tokens=max_new_tokens,
                         do_sample=True, eos_token_id=eos, pad_token_id=0, **warpers)
    return out[:, tokens.shape[1] :].tolist()


@pytest.mark.parametrize("warpers", [{"temperature": 1.0, "top_k": 0, "top_p": 1.0},
                                     {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05}])
def test_a_seed_samples_what_transformers_generate_samples(hf_dirs, ours, warpers):
    """The same logits warpers in transformers' order and the same random draws: the same tokens for the same
    torch seed, also after rows have ended and left our batch (transformers keeps them, writing padding)."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 13, 1, 8, 3)]
    torch.manual_seed(11)
    free = generate(ours["llama"], prompts, 20, **warpers)
    eos = [free[0][3], free[3][6]]  # rows that end early; the rest may run on
    torch.manual_seed(11)
    mine = generate(ours["llama"], prompts, 20, eos=eos, **warpers)
    theirs = _hf_sampled(hf_dirs["llama"], prompts, 20, eos, 11, **warpers)
    assert min(len(r) for r in mine) <= 4 and max(len(r) for r in mine) == 20
    for row, reference in zip(mine, theirs, strict=True):
        assert reference == row + [0] * (len(reference) - len(row))


@pytest.mark.parametrize("name, temperature", [("llama", 0.0), ("mistral", 0.0), ("llama", 1.0)])
def test_under_model_impl_transformers_ended_rows_leave_transformers_own_cache(hf_dirs, ours, name, temperature):
    """model.impl=transformers decodes through transformers' cache inside our `KVCache`: rows that end leave that
    cache too (its keys and values stay the running rows'), so each row's tokens, greedy or sampled with a seed,
    are transformers' `generate`'s and our native decoder's, after the first row ends as before it."""
    model = hf_transformers.from_hf(hf_dirs[name]).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 13, 1, 8)]
    torch.manual_seed(11)
    free = generate(model, prompts, 16, temperature=temperature)
    eos = [free[0][1], free[3][4]]  # rows 0 and 3 end early, at different steps; the batch shrinks twice or more
    torch.manual_seed(11)
    mine = generate(model, prompts, 16, eos=eos, temperature=temperature)
    torch.manual_seed(11)
    native = generate(ours[name], prompts, 16, eos=eos, temperature=temperature)
    theirs = (_hf_sampled(hf_dirs[name], prompts, 16, eos, 11, temperature=temperature, top_k=0) if temperature
              else _hf_greedy(hf_dirs[name], prompts, 16, eos, pad=0))
    assert len(mine[0]) <= 2 and len(mine[3]) <= 5 and len(mine[0]) != len(mine[3])
    assert max(len(r) for r in mine) == 16
    for row, (ours_row, reference) in enumerate(zip(mine, theirs, strict=True)):
        assert reference == ours_row + [0] * (len(reference) - len(ours_row)), row
    assert mine == native

def test_the_draw_is_torch_multinomials_for_any_rows_of_the_batch():
    probs = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).softmax(-1)
    expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(4)).squeeze(1)
    rows = torch.tensor([1, 4, 5])
    drawn = sampling.draw(probs[rows], torch.Generator().manual_seed(4), rows, batch=6)
    assert torch.equal(drawn, expected[rows])


def test_every_row_stops_at_max_new_tokens_or_its_end_token(ours):
    prompts = [[1, 2, 3], [4]]
    assert [len(r) for r in generate(ours["preset"], prompts, 7)] == [7, 7]
    first = generate(ours["preset"], prompts, 1)
    assert [len(r) for r in generate(ours["preset"], prompts, 7, eos=[first[0][0], first[1][0]])] == [1, 1]


def _kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens transformers' temperature, top-k and top-p warpers keep, (batch, vocab) booleans."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores > float("-inf")


@settings(max_examples=examples(60))
@given(vocab=st.integers(2, 40), top_k=st.integers(0, 45), top_p=st.floats(0.05, 1.0),
       temperature=st.floats(0.2, 3.0), seed=st.integers(0, 2**16))
def test_sampling_keeps_to_the_top_k_and_the_top_p_nucleus(vocab, top_k, top_p, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=gen) * 3
    scores = sampling.filtered(logits, temperature, top_k, top_p)
    kept = scores > float("-inf")
    assert torch.equal(kept, _kept(logits, temperature, top_k, top_p))
    # By the definition: at most k tokens (ties at the k-th kept), the most likely ones, and the nucleus is the
    # smallest such set whose probability (after top-k) reaches top_p.
    probs = (logits[0] / temperature).softmax(-1)
    if top_k:
        probs = torch.where(logits[0] >= logits[0].topk(min(top_k, vocab)).values[-1], probs, 0)
    probs = probs / probs.sum()
    inside, outside = probs[kept[0]], probs[~kept[0]]
    assert outside.numel() == 0 or inside.min() >= outside.max()
    assert inside.sum() >= top_p - 1e-5
    assert inside.sum() - inside.min() < top_p + 1e-5
    # Draws come only from the kept tokens, as often as their renormalised probabilities say.
    draws = sampling.next_token(logits.expand(4000, vocab), temperature, top_k, top_p, generator=gen)
    assert bool(kept[0, draws].all())
    frequency = torch.bincount(draws, minlength=vocab) / draws.numel()
    torch.testing.assert_close(frequency, scores[0].softmax(-1), rtol=0, atol=0.04)


def test_temperature_zero_is_greedy_and_a_seed_repeats_a_sample(ours):
    model, prompts = ours["preset"], [[5, 6, 7], [8, 9]]
    assert generate(model, prompts, 6, temperature=0.0) == generate(model, prompts, 6)
    draw = [generate(model, prompts, 12, temperature=1.5, top_k=50, top_p=0.95,
                     generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert draw[0] == draw[1] != draw[2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature=-0.5: must be >= 0"),
        ({"top_k": -1}, "top_k=-1: must be >= 0"),
        ({"top_p": 0.0}, "top_p=0.0: must be in (0, 1]"),
        ({"max_new_tokens": 0}, "max_new_tokens=0: must be >= 1"),
        ({"max_new_tokens": 200}, "plus max_new_tokens=200 exceeds the model's 128 positions"),
    ],
)
def test_bad_settings_are_refused_by_name(ours, kwargs, message):
    with pytest.raises(ValueError) as e:
        generate(ours["preset"], [[1, 2]], **{"max_new_tokens": 4, **kwargs})
    assert message in str(e.value)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "tp"])
@pytest.mark.e2e
def test_under_a_strategy_each_rank_generates_its_own_prompts(hf_dirs, ours, strategy, tmp_path):
    """Two gloo ranks under torchrun (tests/trainer/generate_ranks.py): rank 1's rows end within three steps
    while rank 0's run all sixteen, and each rank writes what one process writes for its prompts."""
    from tests.trainer import generate_ranks

    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "-m", "tests.trainer.generate_ranks", hf_dirs["qwen2"], strategy, str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        with open(tmp_path / f"rank-{rank}.json") as f:
            written = json.load(f)
        group = rank if strategy != "tp" else 0
        assert written["prompts"] == generate_ranks.prompts(group)
        eos = generate_ranks.end_tokens(ours["qwen2"], group)
        assert written["completions"] == generate(ours["qwen2"], written["prompts"], 16, eos=eos)
    if strategy != "tp":
        with open(tmp_path / "rank-1.json") as f:
            assert max(len(c) for c in json.load(f)["completions"]) <= 3
