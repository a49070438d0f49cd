"""What a run reads: the corpora (`corpus`: byte-level text and Parquet token rows, built once into the
cache), chat and preference conversations (`chat`), and where each split's batches come from (`splits`:
the local corpus or the cache nodes)."""

from trainer.data.chat import ChatDataset
from trainer.data.corpus import check_corpus, corpus_key, prepare

__all__ = ["ChatDataset", "check_corpus", "corpus_key", "prepare"]
