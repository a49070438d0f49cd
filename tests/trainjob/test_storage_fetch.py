"""`trainjob.storage.fetch` against moto's real S3 server on loopback (tests/s3_server.py) and the Hub's double
(tests/hub_server.py): a URL is copied once into the cache keyed by its objects' versions, a second fetch copies
nothing, a changed object (a new ETag, a new commit) is fetched again, and each store's refusal is one line
naming the key, the URL and the cause."""

from __future__ import annotations

import json
import os
import sys

import pytest

from trainjob.storage import fetch, objects
from trainjob.storage.errors import StorageError


def _put(s3, key: str, body: bytes) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=body)


def test_an_s3_prefix_is_copied_once_and_again_when_an_object_changes(s3, tmp_path):
    cache = str(tmp_path / "cache")
    _put(s3, "models/tiny/config.json", b"{}")
    _put(s3, "models/tiny/model.safetensors", b"weights")
    _put(s3, "models/tiny/optimizer.pt", b"not a model file")  # outside Kubeflow's patterns
    first = fetch.fetch("model.path", s3.url("models/tiny"), cache, fetch.MODEL_PATTERNS)
    assert first.copied and sorted(os.listdir(first.local)) == [".fetched.json", "config.json", "model.safetensors"]
    with open(os.path.join(first.local, "model.safetensors"), "rb") as f:
        assert f.read() == b"weights"
    again = fetch.fetch("model.path", s3.url("models/tiny"), cache, fetch.MODEL_PATTERNS)
    assert not again.copied and again.local == first.local
    _put(s3, "models/tiny/model.safetensors", b"new weights")  # a new ETag
    changed = fetch.fetch("model.path", s3.url("models/tiny"), cache, fetch.MODEL_PATTERNS)
    assert changed.copied and changed.local != first.local
    with open(os.path.join(changed.local, "model.safetensors"), "rb") as f:
        assert f.read() == b"new weights"
    etag = s3.client().head_object(Bucket=s3.bucket, Key="models/tiny/model.safetensors")["ETag"].strip('"')
    assert fetch.origin(os.path.join(changed.local, "model.safetensors")) == (
        f"{s3.url('models/tiny')}#model.safetensors", len(b"new weights"), etag)
    assert fetch.origin(str(tmp_path / "elsewhere.json")) is None


def test_a_glob_and_a_single_object_stand_for_their_copies(s3, tmp_path):
    cache = str(tmp_path / "cache")
    for name in ("a.jsonl", "b.jsonl", "c.parquet", "sub/d.jsonl"):
        _put(s3, f"chats/{name}", name.encode())
    glob = fetch.fetch("data.path", s3.url("chats/*.jsonl"), cache)
    assert glob.local.endswith("/*.jsonl")
    import glob as globbing

    assert sorted(os.path.basename(p) for p in globbing.glob(glob.local)) == ["a.jsonl", "b.jsonl"]
    one = fetch.fetch("data.path", s3.url("chats/c.parquet"), cache)
    with open(one.local, "rb") as f:
        assert os.path.basename(one.local) == "c.parquet" and f.read() == b"c.parquet"
    listed = objects.listing("data.path", s3.url("chats"))
    assert [o.path for o in listed] == [f"{s3.bucket}/chats/{n}" for n in ("a.jsonl", "b.jsonl", "c.parquet",
                                                                          "sub/d.jsonl")]
    assert all(o.size == len(o.path.split("chats/")[1]) and len(o.version) == 32 for o in listed)


def test_the_pyarrow_filesystem_of_a_url_reads_and_writes_the_bucket(s3):
    fs, path = objects.filesystem("train.checkpoint_dir", s3.url("runs/exp1"))
    assert path == f"{s3.bucket}/runs/exp1"
    with fs.open_output_stream(f"{path}/x.bin") as out:
        out.write(b"abc")
    assert s3.client().get_object(Bucket=s3.bucket, Key="runs/exp1/x.bin")["Body"].read() == b"abc"


def test_the_stores_refusals_name_key_url_and_cause(s3, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    cases = {
        s3.url("nothing/here"): "no such object: nothing there",
        "s3://no-such-bucket-trainjob/x": "no such bucket or object (FileNotFoundError: The specified bucket does "
                                          "not exist)",
        f"s3://AKIA:secret@{s3.bucket}/x": "holds credentials: give them in the environment",
        "ftp://host/x": "has a scheme trainjob does not read",
        "s3://": "names no bucket",
    }
    for url, reason in cases.items():
        with pytest.raises(StorageError) as e:
            fetch.fetch("model.path", url, cache)
        assert reason in str(e.value) and str(e.value).startswith("invalid config: model.path=")
        assert "\n" not in str(e.value) and "secret" not in str(e.value)
    import moto.settings

    _put(s3, "x", b"1")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks credentials from now on
    with pytest.raises(StorageError, match="credentials refused .*InvalidAccessKeyId|credentials refused .*Access "
                                           "Key Id you provided does not exist"):
        fetch.fetch("data.path", s3.url("x"), cache)
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(StorageError, match=r"the endpoint does not answer \(http://127.0.0.1:9: "
                                           "EndpointConnectionError"):
        fetch.fetch("data.path", s3.url("x"), cache)
    # the cause is told by the error's class: a bucket named with a status code's digits is no refusal of keys
    with pytest.raises(StorageError, match=r"the endpoint does not answer \(http://127.0.0.1:9: "
                                           "EndpointConnectionError"):
        fetch.fetch("data.path", "s3://b-63a2d1403113/AccessDenied/x", cache)
    assert not os.path.exists(cache) or not any(n.startswith(".") for _, _, ns in os.walk(cache) for n in ns)


@pytest.mark.parametrize("url,library", [("gs://bucket/model", "gcsfs"), ("s3://bucket/model", "s3fs"),
                                         ("hf://org/name", "huggingface_hub")])
def test_a_scheme_whose_library_is_missing_names_the_extra(url, library, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, library, None)  # `import <library>` raises ImportError
    with pytest.raises(StorageError) as e:
        fetch.fetch("model.path", url, str(tmp_path))
    assert f"needs {library}, which is not installed: pip install 'trainjob[storage]'" in str(e.value)


def test_a_hub_repo_is_fetched_once_by_its_commit(hub, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w")
    (d / "pytorch_model.bin").write_bytes(b"not fetched")
    repo = hub.add_dir("models", "org/tiny", str(d))
    cache = str(tmp_path / "cache")
    first = fetch.fetch("model.path", "hf://org/tiny", cache, fetch.MODEL_PATTERNS)
    assert sorted(os.listdir(first.local)) == [".fetched.json", "config.json", "model.safetensors"]
    assert len(hub.downloads()) == 2
    with open(os.path.join(first.local, fetch.MANIFEST)) as f:
        assert json.load(f)["commit"] == repo.sha
    assert fetch.origin(os.path.join(first.local, "config.json")) == ("hf://org/tiny#config.json", 2, repo.sha)
    before = len(hub.downloads())
    again = fetch.fetch("model.path", "hf://org/tiny", cache, fetch.MODEL_PATTERNS)
    assert (again.local, again.copied, len(hub.downloads())) == (first.local, False, before)
    repo.files["model.safetensors"] = b"w2"
    repo.commit()
    changed = fetch.fetch("model.path", "hf://org/tiny", cache, fetch.MODEL_PATTERNS)
    assert changed.copied and changed.local != first.local
    with open(os.path.join(changed.local, "model.safetensors"), "rb") as f:
        assert f.read() == b"w2"


def test_a_hub_dataset_glob_and_the_hubs_refusals(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from tests.hub_server import TOKEN

    d = tmp_path / "ds"
    (d / "data").mkdir(parents=True)
    (d / "data" / "train.parquet").write_bytes(b"p")
    (d / "README.md").write_text("card")
    hub.add_dir("datasets", "org/corpus", str(d))
    hub.add_dir("models", "org/gated", str(d), gated=True)
    cache = str(tmp_path / "cache")
    got = fetch.fetch("data.path", "hf://datasets/org/corpus/data/*.parquet", cache)
    assert got.local.endswith("/data/*.parquet") and os.path.isfile(got.local.replace("*", "train"))
    assert not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(got.local)), "README.md"))
    refusals = {
        "hf://org/none": "no such model repository org/none on http://127.0.0.1",
        "hf://org/gated": "org/gated is a gated repository and no token is set: accept its terms on the Hub and "
                          "set HF_TOKEN",
        f"hf://datasets/org/corpus@{'0' * 40}/x": "org/corpus has no revision",
        "hf://just-a-name": "is not a Hub URL trainjob reads",
    }
    for url, reason in refusals.items():
        with pytest.raises(StorageError, match=reason):
            fetch.fetch("model.path", url, cache)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert fetch.fetch("model.path", "hf://org/gated", cache).copied
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(StorageError, match=r"the Hub at http://127.0.0.1:9 does not answer \(ConnectError.*; "
                                           "HF_HUB_OFFLINE=1 uses the copy fetched before"):
        fetch.fetch("model.path", "hf://org/gated", cache)


def test_offline_a_cached_copy_is_used_and_said_so(hub, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    repo = hub.add_dir("models", "org/tiny", str(d))
    cache = str(tmp_path / "cache")
    online = fetch.fetch("model.path", "hf://org/tiny", cache, fetch.MODEL_PATTERNS)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    capsys.readouterr()  # the download's progress bars
    asked = len(hub.requests)
    offline = fetch.fetch("model.path", "hf://org/tiny", cache, fetch.MODEL_PATTERNS)
    assert (offline.local, offline.copied, len(hub.requests)) == (online.local, False, asked)
    assert capsys.readouterr().err == (f"model.path=hf://org/tiny: HF_HUB_OFFLINE=1, using the cached copy of "
                                       f"commit {repo.sha} in {online.local}\n")
    with pytest.raises(StorageError, match="HF_HUB_OFFLINE=1 and no copy of it in .*: fetch it once online"):
        fetch.fetch("model.path", "hf://org/other", cache)


@pytest.mark.parametrize("error,cause", [
    # pyarrow's S3 filesystem (objects.download): its codes in the text, a plain OSError
    (OSError("When reading information for key 'x' in bucket 'b-63a2d1403113': AWS Error NETWORK_CONNECTION during "
             "HeadObject operation: curlCode: 7, Couldn't connect to server"), "the endpoint does not answer"),
    (OSError("When reading information for key 'x' in bucket 'b': AWS Error ACCESS_DENIED during GetObject "
             "operation: No response body."), "credentials refused"),
    (OSError("AWS Error UNKNOWN (HTTP status 403) during HeadObject operation: No response body."),
     "credentials refused"),
    (OSError("google::cloud::Status(PERMISSION_DENIED: caller lacks storage.objects.get)"), "credentials refused"),
    (OSError("Forbidden: bucket/key\nAccess denied."), "credentials refused"),  # gcsfs's 403
    # words of a refusal inside a key are the key's, not the cause
    (OSError("Internal error reading s3://b/Forbidden/AccessDenied/403/connect-timeout"), "the store refused it"),
])
def test_a_refusal_is_told_by_the_clients_codes_not_by_words_in_a_key(error, cause):
    assert objects.refusal(error, "s3").startswith(cause)


def test_a_context_suppressed_with_from_none_does_not_decide_the_cause():
    try:
        try:
            raise TimeoutError("an earlier retry timed out")
        except TimeoutError:
            raise PermissionError("Access Denied") from None
    except PermissionError as e:
        assert objects.refusal(e, "s3").startswith("credentials refused")
