"""What a run reads: the corpora (`corpus`: byte-level text and Parquet token rows, built once into the
cache), the byte-level tokenizer (`tokenizer`), chat and preference conversations (`chat`), and where each
split's batches come from (`splits`: the local corpus or the cache nodes)."""
