"""`data=chat` and `data=preference`: conversations (JSONL or Parquet rows with OpenAI-style `messages`), or
preference pairs (`prompt`, `chosen`, `rejected`), as padded token rows with a loss mask, built once into a
cached corpus like `trainer.data`'s, and the dataset that reads them. A preference row holds the chosen
conversation's row, then the rejected one's.

Each conversation is rendered with the model directory's chat template and tokenizer
(`trainer.data.hf_tokenizer`), cut to `data.seq_len + 1` tokens, and padded; `loss_mask` marks the tokens
`data.chat.mask` counts: every assistant turn (the template's `{% generation %}` blocks, or each turn found
message by message on a stock template), the last one, or all. A conversation whose kept part has no counted
token after its first is dropped (it would teach nothing), as is one with no assistant turn or no messages;
corpus.json counts them by reason, so that a split left too small names them. Rows are
`{"tokens": int32[seq_len + 1], "loss_mask": int8[seq_len + 1]}`; ids of any vocabulary fit. With
`data.packing=true`, whole conversations are packed in order into each row instead, and a `documents` column
numbers them, so that the model attends, and counts positions, within each only; data=preference packs whole
pairs (chosen, then rejected: documents 2k and 2k + 1 of a row) into rows of 2 x seq_len + 1 tokens, each
conversation cut to seq_len tokens (recipe=dpo's padding-free rows).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from datacache.local import LocalDataset
from datacache.parquet import parquet_files, read_token_rows
from trainer.data import trl_forms
from trainer.data.corpus import build_once, dropped_text, eval_share
from trainer.data.hf_tokenizer import HFTokenizer, TemplateMaskError
from trainer.errors import ConfigError, UserCodeError

log = logging.getLogger(__name__)
ROWS_PER_SHARD = 8192


def source_files(path: str) -> list[str]:
    """The files of `data.path`: a .jsonl (or .json) file, or Parquet files (a file, a directory or a glob)."""
    if path.endswith((".jsonl", ".json")) and os.path.isfile(path):
        return [path]
    files = parquet_files(path)
    if not files:
        raise ConfigError(
            "data.path",
            path,
            "data=chat and data=preference read a .jsonl file, or Parquet files (a file, a directory "
            "or a glob), of rows with 'messages'; there is none there",
        )
    return files


def source_rows(path: str, columns: tuple[str, ...]) -> Iterator[tuple[str, int, object]]:
    """(file, row number, row) of every row of the source."""
    for file in source_files(path):
        if file.endswith((".jsonl", ".json")):
            with open(file, "rb") as f:
                for i, raw in enumerate(f):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise ConfigError("data.path", path, f"line {i + 1} of {file} is not UTF-8 text "
                                          f"(byte {e.start + 1}: {raw[e.start:e.start + 1]!r})") from None
                    if line.strip():
                        try:
                            yield file, i, json.loads(line)
                        except json.JSONDecodeError as e:
                            raise ConfigError("data.path", path, f"line {i + 1} of {file} is not JSON ({e})") from None
            continue
        names = pq.ParquetFile(file).schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(
                "data.path",
                path,
                f"{file} has no {', '.join(repr(c) for c in missing)} column; it has {', '.join(names)}",
            )
        yield from ((file, i, row) for i, row in enumerate(pq.read_table(file, columns=list(columns) or None)
                                                           .to_pylist()))


def documents(name: str, path: str) -> Iterator[tuple[str, list[list[dict]]]]:
    """(document id, its conversations) of every row, in any of TRL's forms the kind reads (`trl_forms`): one for
    data=chat, two for data=preference (chosen, then rejected). A row of another form raises ConfigError."""
    root = None
    for file, i, row in source_rows(path, ()):
        root = root or os.path.dirname(os.path.abspath(file))
        doc = f"{os.path.relpath(os.path.abspath(file), root)}:{i}"
        yield doc, trl_forms.conversations(name, row, f"row {i + 1} of {file}", path)


def encode_row(tok: HFTokenizer, messages: list[dict], seq_len: int, pad_id: int, mask_mode: str = "assistant"
               ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss mask) of one conversation, cut and padded to seq_len + 1. Raises TemplateMaskError."""
    ids, mask = tok.apply_chat_template(messages, mask_mode)
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    pad = seq_len + 1 - len(ids)
    return (np.array(ids + [pad_id] * pad, dtype=np.int32), np.array(mask + [0] * pad, dtype=np.int8))


def pack(rows: list[tuple[np.ndarray, np.ndarray, int]], seq_len: int, pad_id: int, pairs: bool = False):
    """Conversations (tokens, mask, length) packed greedily, in order, into rows of seq_len + 1: (tokens, mask,
    documents), where documents numbers each row's conversations from 0 and its padding after them. `pairs`
    (data=preference): the conversations come two by two (chosen, rejected), each pair kept in one row, and rows
    are 2 x seq_len + 1 wide (the conversations cut to seq_len tokens: a pair always fits)."""
    width, packed, current = (2 * seq_len if pairs else seq_len) + 1, [], []
    step = 2 if pairs else 1

    def flush():
        tokens = np.full(width, pad_id, np.int32)
        mask, documents = np.zeros(width, np.int8), np.full(width, len(current), np.int32)
        at = 0
        for i, (t, m, n) in enumerate(current):
            tokens[at : at + n], mask[at : at + n], documents[at : at + n] = t[:n], m[:n], i
            at += n
        packed.append((tokens, mask, documents))
        current.clear()

    for start in range(0, len(rows), step):
        unit = rows[start : start + step]
        if current and sum(n for _, _, n in current + unit) > width:
            flush()
        current.extend(unit)
    if current:
        flush()
    return packed


def padding_id(tok: HFTokenizer) -> int:
    """The id chat and preference rows are padded with: the tokenizer's pad token, else its eos token, else 0."""
    return next((i for i in (tok.token_id("pad_token"), tok.token_id("eos_token")) if i is not None), 0)


def _length(tokens: np.ndarray, mask: np.ndarray, pad_id: int) -> int:
    """How many of a padded row's tokens are the conversation's (up to its last non-pad or counted token)."""
    real = np.nonzero((tokens != pad_id) | (mask != 0))[0]
    return int(real[-1]) + 1 if len(real) else 0


def source_fingerprint(cfg, model_path: str | None) -> dict:
    """What a built corpus was made from: the source files (path, size, time) and the digest of the tokenizer
    of the model directory `model_path` ("bytes" for None: a built-in preset's byte tokenizer)."""
    files = [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in source_files(cfg.path)]
    if model_path is None:
        return {"files": files, "tokenizer": "bytes"}
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        file = os.path.join(model_path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                digest.update(f.read())
    return {"files": files, "tokenizer": digest.hexdigest()}


def _write(rows: list[tuple[np.ndarray, np.ndarray]], seq_len: int, out_dir: str) -> int:
    os.makedirs(out_dir)
    width = len(rows[0][0]) if rows else seq_len + 1
    columns = [("tokens", np.int32), ("loss_mask", np.int8)]
    if rows and len(rows[0]) == 3:  # packed rows
        columns.append(("documents", np.int32))
    arrays = {
        name: np.stack([r[i] for r in rows]) if rows else np.zeros((0, width), kind)
        for i, (name, kind) in enumerate(columns)
    }
    for i, start in enumerate(range(0, max(len(rows), 1), ROWS_PER_SHARD)):
        table = pa.table(
            {
                name: pa.FixedSizeListArray.from_arrays(pa.array(a[start : start + ROWS_PER_SHARD].reshape(-1)), width)
                for name, a in arrays.items()
            }
        )
        pq.write_table(table, os.path.join(out_dir, f"shard-{i:05d}.parquet"))
    return len(rows)


def _encode(d, tok: HFTokenizer, pad: int, model_path: str, doc_id: str, chats: list[list[dict]]
            ) -> list[tuple[np.ndarray, np.ndarray]] | str:
    """The rows of document `doc_id`'s conversations, or why they are dropped (data section `d`)."""
    if not any(m["content"] for messages in chats for m in messages):
        return "empty"
    if d.chat.mask != "all" and not all(any(m["role"] == "assistant" for m in c) for c in chats):
        return "no assistant turn"
    cut = d.seq_len - 1 if d.packing and d.name == "preference" else d.seq_len  # a packed pair fits its row
    try:
        encoded = [encode_row(tok, messages, cut, pad, d.chat.mask) for messages in chats]
    except TemplateMaskError as e:
        raise ConfigError("data.chat.mask", d.chat.mask, f"the chat template of model.path={model_path} {e} "
                          f"(conversation {doc_id} of data.path={d.path}), so its assistant turns cannot be "
                          "found message by message: use data.chat.mask=last (the last assistant turn "
                          "only) or data.chat.mask=all (every token), or a template with "
                          "{% generation %} blocks") from None
    except Exception as e:  # the template raised (raise_exception, an undefined name, a bug of its own)
        raise UserCodeError(f"the chat template of model.path={model_path}", e, f"on conversation {doc_id} of "
                            f"data.path={d.path}, before the first step") from e
    if not all(mask[1:].any() for _, mask in encoded):
        limit = f"data.seq_len + 1 = {d.seq_len + 1}" if cut == d.seq_len else f"data.seq_len = {d.seq_len}"
        return f"no counted token within {limit} tokens"
    return encoded


def prepare(cfg) -> str:
    """The chat corpus directory for run config `cfg`, built first when missing."""
    d, model_path = cfg.data, cfg.model.path
    tok = HFTokenizer(model_path) if os.path.isfile(os.path.join(model_path, "tokenizer.json")) else None
    if tok is None or not tok.chat_template:
        raise ConfigError(
            "model.path",
            model_path,
            f"data={d.name} needs the directory's tokenizer.json and a chat "
            "template (in tokenizer_config.json or chat_template.jinja)",
        )
    settings = {
        "name": d.name,
        "seq_len": d.seq_len,
        "eval_percent": eval_share(d),
        "source": source_fingerprint(d, model_path),
        "format": 2,
        "packing": bool(d.packing),
        "mask": d.chat.mask,
    }
    pad = padding_id(tok)

    def write(tmp: str) -> dict:
        splits: dict[str, list] = {"train": [], "eval": []}
        dropped: dict[str, int] = {}
        for doc_id, chats in documents(d.name, d.path):
            encoded = _encode(d, tok, pad, model_path, doc_id, chats)
            if isinstance(encoded, str):
                dropped[encoded] = dropped.get(encoded, 0) + 1
                continue
            in_eval = zlib.crc32(doc_id.encode()) % 10_000 < eval_share(d) * 100
            splits["eval" if in_eval else "train"].append(encoded)
        total = sum(len(rows) for rows in splits.values()) + sum(dropped.values())
        if d.packing:
            splits = {
                name: pack([(t, m, _length(t, m, pad)) for convs in rows for t, m in convs], d.seq_len, pad,
                           pairs=d.name == "preference")
                for name, rows in splits.items()
            }
        else:  # a preference row: the chosen conversation's row, then the rejected one's
            splits = {name: [tuple(np.concatenate(c) for c in zip(*convs, strict=True)) for convs in rows]
                      for name, rows in splits.items()}
        counts = {name: _write(rows, d.seq_len, os.path.join(tmp, name)) for name, rows in splits.items()}
        top = max((int(row[0].max()) for rows in splits.values() for row in rows), default=0)
        if dropped:
            log.warning("data=%s: %s", d.name, dropped_text(dropped, total))
        return {"rows": counts, "max_token_id": top, "dropped": dropped, "conversations": total}

    return build_once(d.cache_dir, d.name, settings, write)


class ChatDataset(LocalDataset):
    """A chat corpus split: each batch is `{"tokens", "loss_mask"}` for this rank."""

    def __init__(self, path: str, **kw):
        super().__init__(path, **kw)
        self.masks = read_token_rows(path, "loss_mask")
        files = parquet_files(path)
        packed = bool(files) and "documents" in pq.ParquetFile(files[0]).schema_arrow.names
        self.documents = read_token_rows(path, "documents") if packed else None

    def fetch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        batch = {"tokens": torch.from_numpy(self.rows[rows]), "loss_mask": torch.from_numpy(self.masks[rows])}
        if self.documents is not None:
            batch["documents"] = torch.from_numpy(self.documents[rows])
        return batch
