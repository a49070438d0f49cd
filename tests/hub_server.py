"""A stand-in for the Hugging Face Hub, on loopback: a test double, because the real Hub cannot be reached from
the machines the tests run on. It answers the HTTP calls `huggingface_hub` makes for `repo_info` (`model_info`,
`dataset_info`), `list_repo_tree` and `hf_hub_download` (so `snapshot_download` too) of the repositories a test
puts in it, as the Hub answers them: a repository's commit (`sha`), its files' tree, the files with the
`X-Repo-Commit` and `ETag` headers, and the Hub's refusals (`X-Error-Code`: RepoNotFound, RevisionNotFound,
GatedRepo). `HF_ENDPOINT` points `huggingface_hub` at it; `requests` records every call, so a test can count the
downloads. Only the Hub is doubled: the S3 tests use moto's real server (tests/s3_server.py)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest

from trainjob.nodes import LOCALHOST

TOKEN = "hf_trainjob_test_token_0123456789"


@dataclass
class Repo:
    """One repository: its files, the commit they are at, and whether it is gated (then only TOKEN reads it)."""

    files: dict[str, bytes]
    gated: bool = False
    sha: str = field(default="")

    def __post_init__(self):
        self.commit()

    def commit(self) -> None:
        """A new commit of the current files (its sha hashes them)."""
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + hashlib.sha1(self.files[name]).digest())
        self.sha = digest.hexdigest()


class Hub:
    """The server: `repos` by (type, id) where type is `models` or `datasets`; `requests`: (method, path)."""

    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer((LOCALHOST, 0), _handler(self))
        self.endpoint = f"http://{LOCALHOST}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add_dir(self, kind: str, repo_id: str, local: str, gated: bool = False) -> Repo:
        files = {}
        for top, _, names in os.walk(local):
            for name in names:
                with open(os.path.join(top, name), "rb") as f:
                    files[os.path.relpath(os.path.join(top, name), local)] = f.read()
        self.repos[(kind, repo_id)] = Repo(files, gated)
        return self.repos[(kind, repo_id)]

    def downloads(self) -> list[str]:
        """The file downloads asked for (GETs of a file, not HEADs or the API)."""
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    """Answers as the Hub answers, from `hub` (set on a subclass per server)."""

    hub: Hub

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _refuse(self, status: int, code: str) -> None:
        self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code,
                                                                   "Content-Type": "application/json"})

    def _repo(self, kind: str, repo_id: str, rev: str) -> Repo | None:
        repo = self.hub.repos.get((kind, repo_id))
        if repo is None:
            self._refuse(401, "RepoNotFound")
        elif rev not in ("main", repo.sha):
            self._refuse(404, "RevisionNotFound")
        else:
            return repo
        return None

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = unquote(urlparse(self.path).path)
        self.hub.requests.append((self.command, path))
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            return self._api(parts[1], f"{parts[2]}/{parts[3]}", parts[4], parts[5])
        kind = "datasets" if parts[0] == "datasets" else "models"
        parts = parts[1:] if kind == "datasets" else parts
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(kind, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        self._send(404)

    def _api(self, kind: str, repo_id: str, what: str, rev: str) -> None:
        repo = self._repo(kind, repo_id, rev)
        if repo is None:
            return
        if what == "revision":
            body = {"id": repo_id, "sha": repo.sha, "private": False, "gated": "auto" if repo.gated else False,
                    "siblings": [{"rfilename": n} for n in sorted(repo.files)]}
        else:
            body = [{"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for n, b in sorted(repo.files.items())]
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _file(self, kind: str, repo_id: str, rev: str, name: str) -> None:
        repo = self._repo(kind, repo_id, rev)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._refuse(401, "GatedRepo")
        if name not in repo.files:
            return self._refuse(404, "EntryNotFound")
        body = repo.files[name]
        self._send(200, body, {"X-Repo-Commit": repo.sha, "ETag": f'"{hashlib.sha1(body).hexdigest()}"',
                               "Content-Type": "application/octet-stream"})


def _handler(hub: Hub) -> type:
    return type("Handler", (_Handler,), {"hub": hub})


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The double, with HF_ENDPOINT pointing at it (this process: huggingface_hub's constants, read at its
    import; subprocesses: the environment), HF_HOME in the test's directory, no token and online."""
    server = Hub()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)  # and what huggingface_hub made of it at import
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield server
    server.close()
