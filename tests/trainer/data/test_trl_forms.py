"""TRL's dataset formats (its "Dataset formats and types" page: standard and conversational; language modeling,
prompt-only, prompt-completion, preference with an explicit or an implicit prompt) read by the recipes' data kinds
as they are, from .jsonl and Parquet files; the implicit prompt split as TRL's own `extract_prompt` (PyPI's trl)
splits it; a row of another form refused in one line naming its columns and the forms accepted."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.config import ConfigError
from trainer.data import trl_forms
from trainer.data.chat import documents
from trainer.data.prompts import _prompt, _prompt_rows

USER = {"role": "user", "content": "What color is the sky?"}
BLUE, GREEN = {"role": "assistant", "content": "It is blue."}, {"role": "assistant", "content": "It is green."}

# (kind, TRL's example row of a form, the conversations the recipe renders)
FORMS = [
    ("chat", {"messages": [USER, BLUE]}, [[USER, BLUE]]),  # language modeling, conversational
    ("chat", {"prompt": "The sky is", "completion": " blue."},  # prompt-completion, standard
     [[{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": " blue."}]]),
    ("chat", {"prompt": [USER], "completion": [BLUE]}, [[USER, BLUE]]),  # prompt-completion, conversational
    ("preference", {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},  # explicit, standard
     [[{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": " blue."}],
      [{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": " green."}]]),
    ("preference", {"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN]},  # explicit, conversational
     [[USER, BLUE], [USER, GREEN]]),
    ("preference", {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # implicit, standard
     [[{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": " blue."}],
      [{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": " green."}]]),
    ("preference", {"chosen": [USER, BLUE], "rejected": [USER, GREEN]}, [[USER, BLUE], [USER, GREEN]]),  # implicit
]


@pytest.mark.parametrize(("kind", "row", "expected"), FORMS, ids=[f"{k}-{'-'.join(r)}" for k, r, _ in FORMS])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_each_trl_form_is_read_as_it_is(kind, row, expected, fmt, tmp_path):
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        path.write_text(json.dumps(row) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist([row]), path)
    assert [chats for _, chats in documents(kind, str(path))] == [expected]


def test_prompt_only_rows_standard_and_conversational(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({"prompt": "The sky is"}, {"prompt": [USER]})) + "\n")
    assert [_prompt(row, file, i, str(path)) for file, i, row in _prompt_rows(str(path))] == ["The sky is", [USER]]


@pytest.mark.parametrize(("chosen", "rejected"), [
    ("The sky is blue.", "The sky is green."), ("Same words", "Same words"), (" a", " b"),
    ([USER, BLUE], [USER, GREEN]),
])
def test_the_implicit_prompt_is_where_trls_extract_prompt_puts_it(chosen, rejected):
    from trl.data_utils import extract_prompt

    trl = extract_prompt({"chosen": chosen, "rejected": rejected})
    assert trl_forms.extract_prompt(chosen, rejected) == (trl["prompt"], trl["chosen"], trl["rejected"])


@pytest.mark.parametrize(("kind", "row", "columns"), [
    ("chat", {"text": "The sky is blue."}, "text"),
    ("chat", {"prompt": "The sky is"}, "prompt"),
    ("preference", {"prompt": "The sky is", "chosen": " blue."}, "prompt, chosen"),
    ("preference", {"chosen": 1, "rejected": 2}, "chosen, rejected"),
])
def test_another_form_is_refused_naming_its_columns_and_the_forms_accepted(kind, row, columns, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as e:
        list(documents(kind, str(path)))
    assert f"row 1 of {path} is not a form data={kind} reads (its columns: {columns};" in str(e.value)
    assert trl_forms.ACCEPTED[kind] in str(e.value) and "\n" not in str(e.value)
