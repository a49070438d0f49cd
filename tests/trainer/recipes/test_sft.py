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
from trainer.data import chat
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
        tokens, loss_mask = chat.encode_row(ours, messages, SEQ, pad)
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
def test_an_sft_run_trains_on_chats(chat_setup, run_cli, tmp_path):
    model, path, _ = chat_setup
    run_dir = tmp_path / "run"
    proc = run_cli(
        "model=hf",
        f"model.path={model}",
        *ARGS,
        f"data.path={path}",
        "data.packing=true",
        "train.max_steps=6",
        "train.eval_every=6",
        "optim.lr=1e-2",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(str(run_dir))]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert np.isfinite(read_summary(str(run_dir))["final_eval_loss"])


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
    assert ("data.packing=True: packs conversations of data=chat or pairs of data=preference; data=stdlib has "
            "none to pack" in compose_refused(tmp_path, capsys, "data.packing=true"))
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


@settings(max_examples=examples(40))
@given(st.lists(st.integers(1, 12), min_size=1, max_size=12), st.booleans())
def test_packing_keeps_every_conversation_whole_and_in_order(lengths, pairs):
    """data=chat packs conversations; data=preference (pairs) packs (chosen, rejected) pairs, each in one row."""
    seq, pad = 12, 99
    lengths = (lengths[: len(lengths) // 2 * 2] or [3, 4]) if pairs else lengths
    rows = [(np.arange(n, dtype=np.int32) + 100 * i, np.ones(n, np.int8), n) for i, n in enumerate(lengths)]
    packed = chat.pack(rows, seq, pad, pairs=pairs)
    found = []
    for tokens, mask, documents in packed:
        assert len(tokens) == len(mask) == len(documents) == (2 * seq if pairs else seq) + 1
        assert not pairs or documents[tokens != pad].max() % 2 == 1  # whole pairs: an even number of documents
        real = tokens != pad  # the generated ids are never the pad id
        assert list(documents) == sorted(documents) and not mask[~real].any()
        assert (documents[~real] == documents[real].max() + 1).all()  # padding: a document of its own
        found += [tokens[real & (documents == d)].tolist() for d in range(int(documents[real].max()) + 1)]
    assert found == [r[0].tolist() for r in rows]
