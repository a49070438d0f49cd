"""Tell a storage URL from a local path: `is_url`, `scheme_of`, and the schemes trainjob reads and writes."""

from __future__ import annotations

SCHEMES = ("hf", "s3", "gs")


def scheme_of(path: str) -> str | None:
    """The URL's scheme (`hf`, `s3`, `gs`, or any other `<scheme>://`), None for a local path."""
    head, sep, _ = str(path).partition("://")
    return head.lower() if sep and head.isidentifier() else None


def is_url(path: str) -> bool:
    """True for a storage URL this project reads (one of `SCHEMES`)."""
    return scheme_of(path) in SCHEMES
