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
`{"tokens": int32[seq_len + 1], "loss_mask": int8[seq_len + 1], "lengths": int32[1]}` (a preference row:
twice the width, and two lengths); ids of any vocabulary fit. `lengths` holds each conversation's real (not
padding) token count, from which a micro-batch is padded only to its longest row or carries no padding at all
(`data.packing`, `trainer.data.packing`).
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

from datacache.local import LocalDataset
from datacache.parquet import parquet_files, read_table
from trainer.data import sources, trl_forms
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
        yield from ((file, i, row) for i, row in enumerate(read_table(file, list(columns) or None)
                                                           .to_pylist()))


def documents(name: str, path: str) -> Iterator[tuple[str, list]]:
    """(document id, its conversations) of every row, in any of TRL's forms the kind reads (`trl_forms`): one for
    data=chat, two for data=preference (chosen, then rejected); for name "unpaired" (data=preference under
    recipe=kto) its (prompt, completion, label) triples. A row of another form raises ConfigError."""
    root = None
    for file, i, row in source_rows(path, ()):
        root = root or os.path.dirname(os.path.abspath(file))
        doc = f"{os.path.relpath(os.path.abspath(file), root)}:{i}"
        where = f"row {i + 1} of {file}"
        yield doc, (trl_forms.unpaired(row, where, path) if name == "unpaired"
                    else trl_forms.conversations(name, row, where, path))


def in_eval(doc_id: str, data) -> bool:
    """Whether document `doc_id` goes to the eval split (a hash of its id against `data.eval_percent`)."""
    return zlib.crc32(doc_id.encode()) % 10_000 < eval_share(data) * 100


def encode_row(tok: HFTokenizer, messages: list[dict], seq_len: int, pad_id: int, mask_mode: str = "assistant"
               ) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, loss mask, real length) of one conversation, cut and padded to seq_len + 1. Raises
    TemplateMaskError."""
    ids, mask = tok.apply_chat_template(messages, mask_mode)
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    pad = seq_len + 1 - len(ids)
    return (np.array(ids + [pad_id] * pad, dtype=np.int32), np.array(mask + [0] * pad, dtype=np.int8), len(ids))


def padding_id(tok: HFTokenizer) -> int:
    """The id chat and preference rows are padded with: the tokenizer's pad token, else its eos token, else 0."""
    return next((i for i in (tok.token_id("pad_token"), tok.token_id("eos_token")) if i is not None), 0)


def source_fingerprint(cfg, model_path: str | None) -> dict:
    """What a built corpus was made from: the source files (path, size, time) and the digest of the tokenizer
    of the model directory `model_path` ("bytes" for None: a built-in preset's byte tokenizer)."""
    files = [sources.identity(f) for f in source_files(sources.local(cfg))]
    if model_path is None:
        return {"files": files, "tokenizer": "bytes"}
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        file = os.path.join(model_path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                digest.update(f.read())
    return {"files": files, "tokenizer": digest.hexdigest()}


def write_rows(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], widths: tuple[int, int, int], out_dir: str,
               labels: list[bool] | None = None) -> int:
    """Rows (tokens, loss mask, lengths) of `widths` each, as Parquet shards in `out_dir`; with `labels`, a
    `label` column (int8) beside them."""
    os.makedirs(out_dir)
    columns = [("tokens", np.int32), ("loss_mask", np.int8), ("lengths", np.int32)]
    arrays = {
        name: np.stack([r[i] for r in rows]) if rows else np.zeros((0, widths[i]), kind)
        for i, (name, kind) in enumerate(columns)
    }
    for i, start in enumerate(range(0, max(len(rows), 1), ROWS_PER_SHARD)):
        part = slice(start, start + ROWS_PER_SHARD)
        table = {name: pa.FixedSizeListArray.from_arrays(pa.array(a[part].reshape(-1)), widths[j])
                 for j, (name, a) in enumerate(arrays.items())}
        if labels is not None:
            table["label"] = pa.array(np.array(labels[part], dtype=np.int8))
        pq.write_table(pa.table(table), os.path.join(out_dir, f"shard-{i:05d}.parquet"))
    return len(rows)


def _encode(d, tok: HFTokenizer, pad: int, model_path: str, doc_id: str, chats: list[list[dict]]
            ) -> list[tuple[np.ndarray, np.ndarray, int]] | str:
    """The rows of document `doc_id`'s conversations, or why they are dropped (data section `d`)."""
    if not any(m["content"] for messages in chats for m in messages):
        return "empty"
    if d.chat.mask != "all" and not all(any(m["role"] == "assistant" for m in c) for c in chats):
        return "no assistant turn"
    try:
        encoded = [encode_row(tok, messages, d.seq_len, pad, d.chat.mask) for messages in chats]
    except TemplateMaskError as e:
        raise ConfigError("data.chat.mask", d.chat.mask, f"the chat template of model.path={model_path} {e} "
                          f"(conversation {doc_id} of data.path={d.path}), so its assistant turns cannot be "
                          "found message by message: use data.chat.mask=last (the last assistant turn "
                          "only) or data.chat.mask=all (every token), or a template with "
                          "{% generation %} blocks") from None
    except Exception as e:  # the template raised (raise_exception, an undefined name, a bug of its own)
        raise UserCodeError(f"the chat template of model.path={model_path}", e, f"on conversation {doc_id} of "
                            f"data.path={d.path}, before the first step") from e
    if not all(mask[1:].any() for _, mask, _ in encoded):
        return f"no counted token within data.seq_len + 1 = {d.seq_len + 1} tokens"
    return encoded


def template_tokenizer(d, model_path: str) -> HFTokenizer:
    """The tokenizer of model directory `model_path` with its chat template; ConfigError where it has none."""
    tok = HFTokenizer(model_path) if os.path.isfile(os.path.join(model_path, "tokenizer.json")) else None
    if tok is None or not tok.chat_template:
        raise ConfigError(
            "model.path",
            model_path,
            f"data={d.name} needs the directory's tokenizer.json and a chat "
            "template (in tokenizer_config.json or chat_template.jinja)",
        )
    return tok


def build_settings(d, model_path: str) -> dict:
    """What a conversation corpus is built from: the key of its build (`build_once`)."""
    return {"name": d.name, "seq_len": d.seq_len, "eval_percent": eval_share(d),
            "source": source_fingerprint(d, model_path), "format": 3, "mask": d.chat.mask}


def prepare(cfg) -> str:
    """The chat corpus directory for run config `cfg`, built first when missing."""
    d, model_path = cfg.data, cfg.model.path
    tok = template_tokenizer(d, model_path)
    settings = build_settings(d, model_path)
    pad = padding_id(tok)

    def write(tmp: str) -> dict:
        splits: dict[str, list] = {"train": [], "eval": []}
        dropped: dict[str, int] = {}
        for doc_id, chats in documents(d.name, sources.local(d)):
            encoded = _encode(d, tok, pad, model_path, doc_id, chats)
            if isinstance(encoded, str):
                dropped[encoded] = dropped.get(encoded, 0) + 1
                continue
            splits["eval" if in_eval(doc_id, d) else "train"].append(encoded)
        total = sum(len(rows) for rows in splits.values()) + sum(dropped.values())
        # a preference row: the chosen conversation's row, then the rejected one's
        splits = {name: [(*(np.concatenate(c) for c in list(zip(*convs, strict=True))[:2]),
                          np.array([n for _, _, n in convs], np.int32)) for convs in rows]
                  for name, rows in splits.items()}
        n = 2 if d.name == "preference" else 1
        widths = (n * (d.seq_len + 1), n * (d.seq_len + 1), n)
        counts = {name: write_rows(rows, widths, os.path.join(tmp, name)) for name, rows in splits.items()}
        top = max((int(row[0].max()) for rows in splits.values() for row in rows), default=0)
        if dropped:
            log.warning("data=%s: %s", d.name, dropped_text(dropped, total))
        return {"rows": counts, "max_token_id": top, "dropped": dropped, "conversations": total}

    return build_once(d.cache_dir, d.name, settings, write)


class ChatDataset(LocalDataset):
    """A chat corpus split: each batch is `{"tokens", "loss_mask", "lengths"}` for this rank, and `"label"` where
    the split holds one (recipe=kto's unpaired rows)."""

    def __init__(self, path: str, **kw):
        first = sorted(parquet_files(path))[:1]
        label = bool(first) and "label" in pq.ParquetFile(first[0]).schema_arrow.names
        super().__init__(path, columns=("tokens", "loss_mask", "lengths", *(("label",) if label else ())), **kw)
