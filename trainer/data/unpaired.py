"""`data=preference` under `recipe=kto`: TRL's unpaired preference rows (`prompt`, `completion`, `label`), or its
pairs unpaired as TRL's KTOTrainer unpairs them (`unpair_preference_dataset`: the chosen answer desirable, the
rejected one not), tokenized as KTOTrainer tokenizes them, built once into a cached corpus beside the paired one.

Each prompt is rendered with the model directory's chat template and its generation prompt, and the whole
conversation without; the completion is what follows their common prefix in tokens (TRL's `common_prefix_length`:
the end-of-turn tokens after the answer included). A row whose prompt alone fills `data.seq_len + 1` tokens is
dropped (TRL drops those whose prompt fills `max_length`). Rows are

    {"tokens": int32[2 (seq_len + 1)]   the prompt, padded; then the completion's first seq_len + 1 tokens, padded
     "loss_mask": int8[2 (seq_len + 1)] 0 over the prompt's half, 1 over the completion's tokens
     "lengths": int32[2]                the prompt's and the stored completion's token counts
     "label": int8}                     1: desirable

so that a micro-batch makes TRL's sequences, each prompt then its completion cut to `data.seq_len + 1` tokens, and
TRL's mismatched KL sequences, each prompt then another row's completion, cut alike (`trainer.recipes.kto`). Within a
split, as TRL's batched map unpairs 1,000 rows at a time, the rows of each 1,000 documents come as their first
(chosen, or unpaired) completions, then the rejected ones.
"""

from __future__ import annotations

import logging

import numpy as np

from trainer.data.chat import build_settings, documents, in_eval, padding_id, template_tokenizer, write_rows
from trainer.data.corpus import build_once, dropped_text
from trainer.data.hf_tokenizer import HFTokenizer
from trainer.errors import UserCodeError

log = logging.getLogger(__name__)
UNPAIR_ROWS = 1000  # datasets' map batch size, in which TRL's unpair_preference_dataset puts chosen before rejected
PROMPT_FILLS = "a prompt that fills data.seq_len + 1 tokens"


def prompt_completion(tok: HFTokenizer, prompt: list[dict], completion: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) as TRL's KTOTrainer tokenizes a conversational row: the completion starts where
    the prompt with its generation prompt and the whole conversation part."""
    prompt_ids = tok.encode(tok.render(prompt, add_generation_prompt=True)[0], add_special_tokens=False)
    full = tok.encode(tok.render(prompt + completion)[0], add_special_tokens=False)
    common = next((i for i, (a, b) in enumerate(zip(prompt_ids, full, strict=False)) if a != b),
                  min(len(prompt_ids), len(full)))
    return full[:common], full[common:]


def encode(tok: HFTokenizer, prompt: list[dict], completion: list[dict], seq_len: int, pad: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The row (tokens, loss mask, lengths) of one unpaired preference, or None when its prompt fills the row."""
    width = seq_len + 1
    prompt_ids, completion_ids = prompt_completion(tok, prompt, completion)
    if len(prompt_ids) >= width:
        return None
    kept = completion_ids[:width]
    tokens = np.full(2 * width, pad, dtype=np.int32)
    tokens[: len(prompt_ids)], tokens[width : width + len(kept)] = prompt_ids, kept
    mask = np.zeros(2 * width, dtype=np.int8)
    mask[width : width + len(kept)] = 1
    return tokens, mask, np.array([len(prompt_ids), len(kept)], dtype=np.int32)


def _trl_order(docs: list[list[tuple]]) -> list[tuple]:
    """A split's rows in TRL's order: per UNPAIR_ROWS documents, each one's first row, then the pairs' second."""
    rows = []
    for start in range(0, len(docs), UNPAIR_ROWS):
        part = docs[start : start + UNPAIR_ROWS]
        rows += [d[0] for d in part] + [d[1] for d in part if len(d) > 1]
    return rows


def _encoded(d, tok: HFTokenizer, pad: int, model_path: str, doc_id: str, triples: list) -> list[tuple]:
    """(row or None, label) of each unpaired preference of document `doc_id`."""
    try:
        return [(encode(tok, prompt, completion, d.seq_len, pad), label) for prompt, completion, label in triples]
    except Exception as e:  # the template raised (raise_exception, an undefined name, a bug of its own)
        raise UserCodeError(f"the chat template of model.path={model_path}", e, f"on row {doc_id} of "
                            f"data.path={d.path}, before the first step") from e


def prepare(cfg) -> str:
    """The unpaired preference corpus directory for run config `cfg` (recipe=kto), built first when missing."""
    d, model_path = cfg.data, cfg.model.path
    tok = template_tokenizer(d, model_path)
    pad = padding_id(tok)

    def write(tmp: str) -> dict:
        splits: dict[str, list] = {"train": [], "eval": []}
        total, dropped = 0, 0
        for doc_id, triples in documents("unpaired", d.path):
            rows = _encoded(d, tok, pad, model_path, doc_id, triples)
            total += len(rows)
            dropped += sum(row is None for row, _ in rows)
            splits["eval" if in_eval(doc_id, d) else "train"].append(rows)
        counts, top = {}, 0
        for name, docs in splits.items():
            rows = [r for r in _trl_order(docs) if r[0] is not None]
            counts[name] = write_rows([r for r, _ in rows], (2 * (d.seq_len + 1),) * 2 + (2,),
                                      f"{tmp}/{name}", labels=[label for _, label in rows])
            top = max([top, *(int(r[0].max()) for r, _ in rows)])
        reasons = {PROMPT_FILLS: dropped} if dropped else {}
        if dropped:
            log.warning("data=%s with recipe=kto: %s", d.name, dropped_text(reasons, total))
        return {"rows": counts, "max_token_id": top, "dropped": reasons, "conversations": total}

    return build_once(d.cache_dir, d.name, {**build_settings(d, model_path), "form": "unpaired"}, write)
