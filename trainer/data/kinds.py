"""Each data kind's home, by the one name the config gives it (`data.name`): what prepares its corpus (built
once into the cache, or found there), what checks that the corpus can feed a job, and the dataset that reads a
split of it. The text kinds (stdlib, parquet) share `trainer.data.corpus`'s build, each reading its own source
(`trainer.data.stdlib`, `trainer.data.parquet`); chat and preference conversations are `trainer.data.chat`'s
(recipe=kto's unpaired ones `trainer.data.unpaired`'s);
GRPO's and RLOO's prompts are `trainer.data.prompts`'s."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from datacache import LocalDataset
from trainer.data import chat, corpus, prompts, unpaired


@dataclass(frozen=True)
class Kind:
    prepare: Callable[[Any], str]  # the job -> its corpus directory, built first where it is missing
    check: Callable[[str, Any], None]  # (corpus, job): raise ConfigError unless the corpus can feed the job
    dataset: type  # reads one split of the corpus: (split directory, **loader options)


def _text(job) -> str:
    return corpus.prepare(job.data)


_TEXT = Kind(_text, corpus.check_corpus, LocalDataset)
def _preference(job) -> str:
    """recipe=kto reads data=preference unpaired (`trainer.data.unpaired`), the other recipes in pairs."""
    return (unpaired.prepare if job.recipe.name == "kto" else chat.prepare)(job)


_CHATS = Kind(chat.prepare, corpus.check_corpus, chat.ChatDataset)
KINDS = {"stdlib": _TEXT, "parquet": _TEXT, "chat": _CHATS,
         "preference": Kind(_preference, corpus.check_corpus, chat.ChatDataset),
         "prompts": Kind(prompts.prepare, prompts.check_corpus, prompts.PromptDataset)}
