"""`recipe=sft` on `data=chat`: the rows are the chat template's tokens as `transformers` renders them, the
loss counts exactly the assistant's tokens, weighted the same whatever the split into ranks and
micro-batches, and a run trains. The model and tokenizer are tiny ones made here (nothing downloaded)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import compose_refused, examples, read_metrics, read_summary
from tests.trainer.hf_models import SAMPLE, add_tokenizer, make_llama
from trainer.data import chat, packing
from trainer.data.hf_tokenizer import HFTokenizer
from trainer.recipes import sft

pytestmark = pytest.mark.timeout(240)
SEQ = 48


def _chats(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        turns = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": rng.choice(SAMPLE)[: rng.randint(5, 40)]})
            turns.append({"role": "assistant", "content": rng.choice(SAMPLE)[: rng.randint(3, 30)]})
        chats.append(turns)
    return chats


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = add_tokenizer(make_llama(str(root)))
    chats = _chats(48)
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return model, str(path), chats


ARGS = [
    "recipe=sft",
    "data=chat",
    f"data.seq_len={SEQ}",
    "data.eval_percent=25",
    "train.global_batch_size=4",
    "train.progress=false",
    "train.log_every=1",
    "lr_schedule.warmup_steps=1",
]


def test_rows_hold_the_template_tokens_and_targets_exactly_the_assistant_tokens(chat_setup):
    from transformers import AutoTokenizer

    model, _, chats = chat_setup
    ours, theirs = HFTokenizer(model), AutoTokenizer.from_pretrained(model)
    pad = ours.token_id("pad_token")
    for messages in chats[:12]:
        ref = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = ref["input_ids"][: SEQ + 1], ref["assistant_masks"][: SEQ + 1]
        tokens, loss_mask, length = chat.encode_row(ours, messages, SEQ, pad)
        assert length == min(len(ref["input_ids"]), SEQ + 1)
        assert tokens[: len(ids)].tolist() == ids and loss_mask[: len(ids)].tolist() == mask
        assert (tokens[len(ids) :] == pad).all() and not loss_mask[len(ids) :].any()
        batch = {"tokens": torch.from_numpy(tokens)[None].long(), "loss_mask": torch.from_numpy(loss_mask)[None]}
        targets = sft.targets(batch, batch["tokens"])[0].tolist()
        labels = [i if m else sft.IGNORE for i, m in zip(ids, mask, strict=True)][1:]
        assert targets[: len(labels)] == labels and set(targets[len(labels) :]) <= {sft.IGNORE}
        if len(ref["input_ids"]) <= SEQ + 1:  # whole: the targets are the assistant's replies, end tokens included
            replies = "".join(m["content"] + "<|end|>" for m in messages if m["role"] == "assistant")
            assert theirs.decode([t for t in targets if t != sft.IGNORE]) == replies


@settings(max_examples=examples(25))
@given(st.lists(st.integers(1, 6), min_size=4, max_size=4), st.sampled_from([1, 2, 4]), st.integers(0, 2**16))
def test_weighted_micro_batch_means_give_the_mean_over_every_counted_token(counts, accum, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = torch.rand(4, 6, generator=gen)
    targets = torch.full((4, 6), sft.IGNORE)
    for row, c in enumerate(counts):
        targets[row, :c] = 1
    chunks = targets.chunk(accum)
    weights = sft.weights(chunks)
    means = [losses.chunk(accum)[i][c != sft.IGNORE].mean() for i, c in enumerate(chunks)]
    total = sum(m * w for m, w in zip(means, weights, strict=True))
    assert float(total) == pytest.approx(float(losses[targets != sft.IGNORE].mean()), rel=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_an_sft_run_trains_on_chats(chat_setup, run_cli, tmp_path):
    model, path, _ = chat_setup
    runs = {}
    for way in ("padding_free", "max_length"):  # padding_free: data.packing unset
        run_dir = tmp_path / way
        proc = run_cli("model=hf", f"model.path={model}", *ARGS, f"data.path={path}", "train.max_steps=6",
                       "train.eval_every=6", "optim.lr=1e-2", "train.grad_accum_steps=2",
                       *([f"data.packing={way}"] if way != "padding_free" else []), f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[way] = read_metrics(str(run_dir)), read_summary(str(run_dir))
    (lines, summary), (padded, padded_summary) = runs["padding_free"], runs["max_length"]
    losses = [m["loss"] for m in lines]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert np.isfinite(summary["final_eval_loss"])
    # The same rows in the same order: the same losses, real tokens and trained tokens, padded or not.
    assert [m["loss"] for m in padded] == pytest.approx(losses, abs=1e-5)
    assert padded_summary["final_eval_loss"] == pytest.approx(summary["final_eval_loss"], abs=1e-5)
    for key in ("tokens", "trained_tokens"):
        assert [m[key] for m in padded] == [m[key] for m in lines]
        assert summary[key] == sum(m[key] for m in lines)
    for m in lines:  # throughput of real tokens: a step's tokens over its time; padding is not counted
        assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(m["tokens"], rel=1e-9)
        assert 0 < m["trained_tokens"] < m["tokens"] < 4 * SEQ


def test_chat_data_that_cannot_train_is_refused_naming_the_key(chat_setup, tmp_path, capsys):
    model, path, _ = chat_setup
    hf = ["model=hf", f"model.path={model}"]
    assert "data='stdlib': recipe=sft trains on data=chat (rows with messages)" in compose_refused(
        tmp_path, capsys, *hf, "recipe=sft"
    )
    assert "recipe='pretrain': data=chat is for recipe=sft" in compose_refused(
        tmp_path, capsys, *hf, "data=chat", f"data.path={path}"
    )
    assert "model='debug': data=chat tokenizes with the model directory's tokenizer" in compose_refused(
        tmp_path, capsys, *ARGS, f"data.path={path}"
    )
    assert ("data.packing='padding_free': data=stdlib reads no packing; data=chat, preference or prompts do"
            in compose_refused(tmp_path, capsys, "data.packing=padding_free"))
    assert "data.packing='True': must be one of padding_free, longest, max_length (padding_free" in compose_refused(
        tmp_path, capsys, *hf, *ARGS, f"data.path={path}", "data.packing=true")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + json.dumps({"text": "x"}))
    err = compose_refused(tmp_path, capsys, *hf, *ARGS, f"data.path={bad}")
    assert f"data.path='{bad}': row 2 of {bad} is not a form data=chat reads (its columns: text;" in err
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode() + b"\n" +
                      '{"messages": [{"role": "user", "content": "café"}]}'.encode("latin-1") + b"\n")
    err = compose_refused(tmp_path, capsys, *hf, *ARGS, f"data.path={latin}")
    assert err.strip() == (f"error: invalid config: data.path='{latin}': line 2 of {latin} is not UTF-8 text "
                           "(byte 47: b'\\xe9')")
    assert not os.path.exists(tmp_path / "run" / "config.yaml")


def test_parquet_chats_read_as_the_same_conversations(chat_setup, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, path, chats = chat_setup
    pq.write_table(pa.table({"messages": chats, "other": list(range(len(chats)))}), tmp_path / "chats.parquet")
    from_parquet = [c for _, (c,) in chat.documents("chat", str(tmp_path / "chats.parquet"))]
    assert from_parquet == [c for _, (c,) in chat.documents("chat", path)] == chats


def test_a_packed_row_gives_each_conversation_the_logits_it_has_alone(chat_setup):
    from trainer.models import from_hf

    model = from_hf(chat_setup[0]).eval()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 320, (1, n), generator=gen) for n in (7, 12, 5)]
    numbers = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)], 1)
    with torch.no_grad():
        packed = model(torch.cat(docs, 1), documents=numbers)
        alone = torch.cat([model(d) for d in docs], 1)
        unpacked = model(torch.cat(docs, 1))
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    assert (unpacked - alone).abs().max() > 1e-2  # without the documents, later ones see earlier ones


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_every_packing_gives_the_padded_rows_loss_and_gradient(chat_setup, impl):
    """data.packing on a micro-batch of chat rows: padded to the longest row, or packed into one row (positions
    restarting, attention within each conversation), the loss and gradient of the rows padded to data.seq_len;
    natively and through transformers' own modeling code (its packed `position_ids` on CPU SDPA)."""
    from trainer.models import from_hf, hf_transformers

    path, _, chats = chat_setup
    model = (from_hf(path) if impl == "native" else hf_transformers.from_hf(path)).eval()
    tok = HFTokenizer(path)
    rows = [chat.encode_row(tok, c, SEQ, tok.token_id("pad_token")) for c in chats[:6]]
    tokens = torch.tensor(np.stack([r[0] for r in rows])).long()
    batch = {"tokens": tokens, "loss_mask": torch.tensor(np.stack([r[1] for r in rows]))}
    target = sft.targets(batch, tokens)
    real = packing.input_lengths(torch.tensor([r[2] for r in rows]), *target.shape)
    assert real.max() > real.min()
    results = {}
    for way in ("max_length", "longest", "padding_free"):
        micro = packing.collate(tokens, target, real, way, multiple=4)
        assert micro.tokens.shape[1] == {"max_length": SEQ, "longest": int(real.max()),
                                         "padding_free": -(-int(real.sum()) // 4) * 4}[way] + 1
        loss = model(micro.tokens[:, :-1], micro.target, micro.inputs_documents)
        results[way] = loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    for way in ("longest", "padding_free"):
        torch.testing.assert_close(results[way][0], results["max_length"][0], rtol=1e-5, atol=1e-6)
        for g, e in zip(results[way][1], results["max_length"][1], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


@settings(max_examples=examples(40))
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(1, 4))
def test_a_packed_row_holds_every_rows_real_inputs_in_order(lengths, multiple):
    """padding_free: each row's real inputs and their targets, one row after another, a document each; the
    positions added for `multiple` count no target; `unpack` puts per-token values back where the rows hold them."""
    seq, rows = 12, len(lengths)
    tokens = torch.arange(rows * (seq + 1)).view(rows, seq + 1)
    target = tokens[:, 1:] + 1000
    real = packing.input_lengths(torch.tensor(lengths), rows, seq)
    micro = packing.collate(tokens, target, real, "padding_free", multiple)
    total = sum(min(n, seq) for n in lengths)
    if min(lengths) >= seq:  # no padding to leave out: the rows as they are
        assert micro.documents is None and micro.tokens is tokens
        return
    inputs, docs = micro.tokens[0, :-1], micro.inputs_documents[0]
    assert inputs.numel() % multiple == 0 and inputs.numel() - total < multiple
    assert inputs[:total].tolist() == [t for r, n in enumerate(lengths) for t in tokens[r, : min(n, seq)].tolist()]
    assert micro.target[0, :total].tolist() == [t for r, n in enumerate(lengths)
                                                for t in target[r, : min(n, seq)].tolist()]
    assert (micro.target[0, total:] == sft.IGNORE).all() and (docs[total:] == rows).all()
    assert docs[:total].tolist() == [r for r, n in enumerate(lengths) for _ in range(min(n, seq))]
    back = packing.unpack(micro.target.float(), micro)
    keep = torch.arange(seq)[None] < real[:, None]
    assert (back[keep] == target[keep].float()).all() and (back[~keep] == 0).all()
