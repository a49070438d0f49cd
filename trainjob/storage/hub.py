"""The Hugging Face Hub (`hf://<org>/<name>[@<revision>]` for a model, `hf://datasets/<org>/<name>[@<revision>]/<glob>`
for a dataset's files) through `huggingface_hub`, which reads `HF_TOKEN`, `HF_HOME`, `HF_ENDPOINT` and
`HF_HUB_OFFLINE` itself: `parse` reads a URL, `commit` asks the Hub which commit a revision is now (the version a
fetch is keyed by), `download` copies that commit's files into a directory. Every refusal is a `StorageError`."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from trainjob.storage.errors import StorageError

# Kubeflow Trainer's model initializer's allow_patterns (pkg/initializers/model/huggingface.py), and *.jinja: the chat
# template transformers saves beside tokenizer_config.json (chat_template.jinja), without which data=chat cannot run.
MODEL_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.gguf", "*.jinja")
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_MODEL = re.compile(rf"hf://(?P<id>{_NAME}/{_NAME})(@(?P<rev>[^/]+))?/?$")
_DATASET = re.compile(rf"hf://datasets/(?P<id>{_NAME}/{_NAME})(@(?P<rev>[^/]+))?(/(?P<glob>.+))?$")


@dataclass(frozen=True)
class Repo:
    """A repository on the Hub: its type (model, dataset), id, the revision asked for, and the files' glob."""

    type: str
    id: str
    revision: str
    glob: str | None


def parse(key: str, url: str) -> Repo:
    """The repository an `hf://` URL names; a URL of another form is refused, saying which forms there are."""
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise StorageError(key, url, "hf:// needs huggingface_hub, which is not installed: pip install "
                           "'trainjob[storage]'") from None
    found = _DATASET.match(url)
    if found:
        return Repo("dataset", found["id"], found["rev"] or "main", found["glob"])
    found = _MODEL.match(url)
    if found and not url.startswith("hf://datasets/"):
        return Repo("model", found["id"], found["rev"] or "main", None)
    raise StorageError(key, url, "is not a Hub URL trainjob reads: give hf://<org>/<name>[@<revision>] (a model) or "
                       "hf://datasets/<org>/<name>[@<revision>]/<glob> (a dataset's files)")


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub's calls raise when the Hub refuses or does not answer: its HTTP client's errors
    (httpx2 in huggingface_hub 2, httpx before) and OSError (its own errors, and OfflineModeIsEnabled)."""
    try:
        import httpx2 as http
    except ImportError:
        import httpx as http
    return http.HTTPError, OSError, ValueError


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _refusal(e: Exception, repo: Repo) -> str:
    """What the Hub's refusal of `repo` means, and what to do."""
    from huggingface_hub import errors

    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if isinstance(e, errors.GatedRepoError):
        return (f"{repo.id} is a gated repository and the Hub refused this token ({text}): accept its terms on the "
                "Hub and set HF_TOKEN (or run `hf auth login`)")
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{repo.id} has no revision {repo.revision!r} ({text})"
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"no such {repo.type} repository {repo.id} on {_endpoint()}, or a private one this token may not "
                f"read ({text}): check the name, and HF_TOKEN for a private one")
    if isinstance(e, errors.HfHubHTTPError):
        return f"the Hub at {_endpoint()} refused it ({text})"
    return f"the Hub at {_endpoint()} does not answer ({text})"


def commit(key: str, url: str, repo: Repo) -> str:
    """The commit `repo.revision` is on the Hub now; a repository that is gated to this caller (no token, or one
    without access) is refused here, before any file is asked for."""
    from huggingface_hub import HfApi, get_token

    try:
        info = HfApi(endpoint=_endpoint()).repo_info(repo.id, repo_type=repo.type, revision=repo.revision)
    except _errors() as e:
        raise StorageError(key, url, _refusal(e, repo)) from None
    if getattr(info, "gated", False) and not get_token():
        raise StorageError(key, url, f"{repo.id} is a gated repository and no token is set: accept its terms on the "
                           "Hub and set HF_TOKEN (or run `hf auth login`)")
    return str(info.sha)


def download(key: str, url: str, repo: Repo, sha: str, patterns: tuple[str, ...] | None, dest: str) -> None:
    """The files of `repo` at commit `sha` that match `patterns` (every file: None), into directory `dest`."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo.id, repo_type=repo.type, revision=sha, local_dir=dest, endpoint=_endpoint(),
                          allow_patterns=list(patterns) if patterns else None)
    except _errors() as e:
        raise StorageError(key, url, _refusal(e, repo)) from None
    shutil.rmtree(os.path.join(dest, ".cache"), ignore_errors=True)  # huggingface_hub's bookkeeping of local_dir
