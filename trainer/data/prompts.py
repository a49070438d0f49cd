"""`data=prompts` for recipe=grpo: JSONL or Parquet rows with a `prompt` (text) or `messages` (a conversation the
model answers, through the model directory's chat template with its generation prompt), and any other columns,
which the reward functions are given. Built once into a cached corpus like `trainer.data`'s: each prompt's
token ids (its last `data.seq_len` when longer, as TRL keeps them), its length, and the row as JSON. Text goes
through the model directory's tokenizer (model=hf), else the byte tokenizer of a built-in preset."""

from __future__ import annotations

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
from datacache.parquet import parquet_files, read_table
from trainer.config.recipe import prompts_per_step
from trainer.data import sources, trl_forms
from trainer.data.chat import source_files, source_fingerprint, source_rows
from trainer.data.corpus import build_once, dropped_text, eval_share, without_eval
from trainer.data.text import Text
from trainer.errors import ConfigError

log = logging.getLogger(__name__)
ROWS_PER_SHARD = 8192


def _prompt_rows(path: str) -> Iterator[tuple[str, int, dict]]:
    """(file, row number, row) of every row, all its columns."""
    for file in source_files(path):
        if file.endswith((".jsonl", ".json")):
            yield from source_rows(file, ())
        else:
            yield from ((file, i, row) for i, row in enumerate(read_table(file).to_pylist()))


def _prompt(row, file: str, i: int, path: str):
    return trl_forms.prompt(row, f"row {i + 1} of {file}", path)


def prompt_text(model_cfg) -> Text:
    """The prompts' tokenizer: the model directory's (model=hf), else the byte tokenizer."""
    if model_cfg.name == "hf":
        return Text(model_cfg.path, key="data.path (messages)", source="model.path")
    return Text(None, key="data.path (messages)")


def prepare(cfg) -> str:
    """The prompts corpus directory for run config `cfg`, built first when missing."""
    d = cfg.data
    text = prompt_text(cfg.model)
    settings = {"name": d.name, "seq_len": d.seq_len, "eval_percent": eval_share(d), "format": 1,
                "source": source_fingerprint(d, cfg.model.path if cfg.model.name == "hf" else None)}

    def write(tmp: str) -> dict:
        splits: dict[str, list] = {"train": [], "eval": []}
        dropped: dict[str, int] = {}
        columns: set[str] = set()
        root = None
        for file, i, row in _prompt_rows(sources.local(d)):
            prompt = _prompt(row, file, i, d.path)
            ids = text.encode(prompt)[-d.seq_len:]
            if not ids:
                dropped["empty"] = dropped.get("empty", 0) + 1
                continue
            root = root or os.path.dirname(os.path.abspath(file))
            doc = f"{os.path.relpath(os.path.abspath(file), root)}:{i}"
            in_eval = zlib.crc32(doc.encode()) % 10_000 < eval_share(d) * 100
            columns |= set(row)
            splits["eval" if in_eval else "train"].append((ids, json.dumps(row, default=str)))
        total = sum(len(rows) for rows in splits.values()) + sum(dropped.values())
        if dropped:
            log.warning("data=prompts: %s", dropped_text(dropped, total))
        for name, rows in splits.items():
            _write(rows, d.seq_len, text.pad, os.path.join(tmp, name))
        top = max((max(ids) for rows in splits.values() for ids, _ in rows), default=0)
        return {"rows": {k: len(v) for k, v in splits.items()}, "max_token_id": int(top), "dropped": dropped,
                "conversations": total, "columns": sorted(columns - {"prompt", "messages"})}

    return build_once(d.cache_dir, d.name, settings, write)


def _write(rows: list[tuple[list[int], str]], seq_len: int, pad: int, out_dir: str) -> None:
    os.makedirs(out_dir)
    for i, start in enumerate(range(0, max(len(rows), 1), ROWS_PER_SHARD)):
        part = rows[start : start + ROWS_PER_SHARD]
        tokens = np.full((len(part), seq_len), pad, np.int32)
        for r, (ids, _) in enumerate(part):
            tokens[r, : len(ids)] = ids
        table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), seq_len),
                          "length": pa.array([len(ids) for ids, _ in part], pa.int32()),
                          "row": pa.array([row for _, row in part], pa.string())})
        pq.write_table(table, os.path.join(out_dir, f"shard-{i:05d}.parquet"))


def check_corpus(corpus: str, cfg) -> None:
    """Raise ConfigError unless the corpus can feed the run: token ids the model has, a step's prompts in each
    split, and every column a reward function names."""
    with open(os.path.join(corpus, "corpus.json")) as f:
        info = json.load(f)
    d, r = cfg.data, cfg.recipe
    if info["max_token_id"] >= cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size, f"the prompts of data.path={d.path} hold token "
                          f"id {info['max_token_id']}: must be > {info['max_token_id']}")
    per_step, how = prompts_per_step(r, cfg.train.global_batch_size)
    for split in ("train", "eval"):
        rows = info["rows"][split]
        if rows < per_step and split == "eval" and d.eval_percent is None:
            log.warning(without_eval(d, rows, per_step))
        elif rows < per_step:
            raise ConfigError("train.global_batch_size", cfg.train.global_batch_size, f"a step takes "
                              f"{per_step} prompts ({how}); the {split} "
                              f"split of data.path={d.path} holds {rows} (data.eval_percent={eval_share(d):g})")
    from trainer.rewards import functions as reward_funcs

    for spec in r.reward_funcs:
        wanted = reward_funcs.columns_needed(reward_funcs.load(spec))
        missing = sorted((wanted or set()) - set(info["columns"]))
        if missing:
            raise ConfigError("recipe.reward_funcs", spec, f"takes {', '.join(missing)}, which the rows of "
                              f"data.path={d.path} do not hold (they hold "
                              f"{', '.join(info['columns']) or 'no other column'})")


class PromptDataset(LocalDataset):
    """A prompts corpus split: each batch is `{"tokens" (right padded), "length", "rows"}` for this rank, "rows"
    the JSON text of each row."""

    def __init__(self, path: str, **kw):
        super().__init__(path, columns=["tokens", "length"], **kw)
        files = parquet_files(path)
        self.records = read_table(files, ["row"]).column("row").to_pylist()

    def fetch(self, rows: np.ndarray) -> dict:
        batch: dict = {c: torch.from_numpy(self.arrays[c][rows]) for c in self.columns}
        batch["rows"] = [self.records[int(i)] for i in rows]
        return batch
