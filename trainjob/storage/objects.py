"""Object stores (`s3://<bucket>/<key>`, `gs://<bucket>/<key>`): `filesystem(key, url)` gives the pyarrow filesystem
and path that read and write a URL; `listing(key, url)` the objects a URL names (a prefix, one object or a glob)
with their sizes and versions (S3's and GCS's ETags), listed through fsspec (s3fs, gcsfs: the `storage` extra),
which, unlike pyarrow, reports ETags. Credentials come from where the stores' own clients look: AWS's environment
variables and ~/.aws (`AWS_ENDPOINT_URL` for S3-compatible stores such as MinIO and Ceph), Google's application
default credentials. Every failure is a `StorageError`: one line naming the key, the URL and the cause."""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from dataclasses import dataclass

from trainjob.storage.errors import StorageError
from trainjob.storage.urls import scheme_of

# The fsspec library that lists each scheme, and the extra that installs it.
LIBRARIES = {"s3": "s3fs", "gs": "gcsfs"}
EXTRA = "pip install 'trainjob[storage]'"
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Obj:
    """One object: its path inside the store (`bucket/key`), size in bytes and version (the ETag)."""

    path: str
    size: int
    version: str


def split(key: str, url: str) -> tuple[str, str]:
    """(scheme, `bucket/key`) of an object store URL; refuses another scheme, a URL with no bucket, or one with
    credentials in it (they would be written wherever the URL is)."""
    scheme = scheme_of(url)
    if scheme not in LIBRARIES:
        raise StorageError(key, url, "is not an object store URL: give s3://<bucket>/<key> or gs://<bucket>/<key>")
    rest = url.split("://", 1)[1].strip("/")
    bucket = rest.split("/", 1)[0]
    if "@" in bucket or ":" in bucket:
        raise StorageError(key, scheme + "://…", "holds credentials: give them in the environment (AWS_ACCESS_KEY_ID, "
                           "~/.aws, GOOGLE_APPLICATION_CREDENTIALS), never in the URL")
    if not bucket:
        raise StorageError(key, url, f"names no bucket: give {scheme}://<bucket>/<key>")
    return scheme, rest


def _endpoint() -> str | None:
    """The S3-compatible endpoint the environment names (MinIO, Ceph), as AWS's own clients read it."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def filesystem(key: str, url: str):
    """(pyarrow filesystem, path inside it) for object store URL `url`, credentials and endpoint from the
    environment as the store's own clients read them. Raises StorageError."""
    import pyarrow.fs as pafs

    scheme, path = split(key, url)
    try:
        if scheme == "s3":
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            retry = pafs.AwsStandardS3RetryStrategy(max_attempts=3)
            return pafs.S3FileSystem(endpoint_override=_endpoint(), region=region, retry_strategy=retry), path
        return pafs.GcsFileSystem(), path
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a bad region, endpoint or credentials
        raise StorageError(key, url, f"its filesystem cannot be opened ({type(e).__name__}: {e})") from None


def fsspec_filesystem(key: str, url: str, retries: int = 1, cached: bool = False):
    """URL `url`'s fsspec filesystem (s3fs, gcsfs; not installed: StorageError naming the extra), with no listing
    cache (other processes write the same prefixes) and `retries` bounded retries of each request beyond the first
    (botocore's own, in its standard mode; s3fs's loop makes one attempt of what botocore has retried). `cached`:
    fsspec keeps one instance per settings (a process's many calls); else a fresh one, which reads the credentials
    the environment holds now."""
    scheme, _ = split(key, url)
    library = LIBRARIES[scheme]
    try:
        module = __import__(library)
    except ImportError:
        raise StorageError(key, url, f"{scheme}:// needs {library}, which is not installed: {EXTRA}") from None
    for name in ("botocore", "aiobotocore", "s3fs"):  # a line per connection at INFO: the run's log is not theirs
        logging.getLogger(name).setLevel(logging.WARNING)
    if scheme == "gs":
        return module.GCSFileSystem(skip_instance_cache=not cached)
    store = module.S3FileSystem(endpoint_url=_endpoint(), skip_instance_cache=not cached, use_listings_cache=False,
                                config_kwargs={"retries": {"total_max_attempts": retries + 1, "mode": "standard"},
                                               "connect_timeout": 5, "read_timeout": 60})
    store.retries = 1
    return store


def probe(key: str, url: str) -> None:
    """Raise StorageError unless `url`'s store answers and this process may list its bucket (the library installed,
    the endpoint reachable, the bucket there, the credentials taken). Writes nothing."""
    scheme, path = split(key, url)
    try:
        fsspec_filesystem(key, url).ls(path.split("/", 1)[0], detail=False)
    except StorageError:
        raise
    except Exception as e:  # botocore's and gcsfs's errors arrive as OSError subclasses, or their own
        raise StorageError(key, url, refusal(e, scheme)) from None


# Credential refusals by their error code (S3's, in a ClientError's response) or HTTP status (GCS's HttpError).
CREDENTIAL_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                    "AllAccessDisabled", "AccountProblem"}
# What the stores' clients write in an error's text, in forms a bucket, key or URL cannot hold by accident:
# botocore's "An error occurred (Code) when calling", pyarrow's "AWS Error CODE during ... (HTTP status N)" and
# Google Cloud C++'s "Status(CODE", and gcsfs's OSError that starts "Forbidden".
UNANSWERED_TEXT = re.compile(r"AWS Error (NETWORK_CONNECTION|SERVICE_UNAVAILABLE|REQUEST_TIMEOUT|SLOW_DOWN) during|"
                             r"Status\((UNAVAILABLE|DEADLINE_EXCEEDED)\b")
CREDENTIALS_TEXT = re.compile(r"An error occurred \((" + "|".join(sorted(CREDENTIAL_CODES)) + r")\) when calling|"
                              r"AWS Error (ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|"
                              r"EXPIRED_TOKEN) during|\(HTTP status 40[13]\)|"
                              r"Status\((PERMISSION_DENIED|UNAUTHENTICATED)\b|^Forbidden")


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and what it was raised from (s3fs raises its own OSError from botocore's ClientError); a context
    suppressed (`from None`) is not followed."""
    seen: list[BaseException] = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return seen


def _unanswered(e: BaseException) -> bool:
    """A connection that failed or timed out: told by the exception's classes (botocore's EndpointConnectionError
    and timeouts, aiohttp's, the builtins), or by pyarrow's own error codes in its text (`UNANSWERED_TEXT`)."""
    return isinstance(e, (ConnectionError, TimeoutError)) or any(
        "ConnectionError" in c.__name__ or "Timeout" in c.__name__ or "ClientConnector" in c.__name__
        for c in type(e).__mro__) or UNANSWERED_TEXT.search(str(e)) is not None


def _credentials_refused(e: BaseException) -> bool:
    """A refusal of the credentials: s3fs's PermissionError, botocore's code or status, gcsfs's HttpError code,
    or a client's own code in its text (`CREDENTIALS_TEXT`)."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        error, status = response.get("Error", {}), response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    else:
        error, status = {}, getattr(e, "code", None)
    return isinstance(e, PermissionError) or error.get("Code") in CREDENTIAL_CODES or status in (401, 403) or \
        CREDENTIALS_TEXT.search(str(e)) is not None


def refusal(e: Exception, scheme: str) -> str:
    """What a store's refusal means, in words (the exception's text names the bucket, key or code)."""
    text = f"{type(e).__name__}: {e}"
    chain = _chain(e)
    if any(_unanswered(c) for c in chain):
        endpoint = (_endpoint() or "the store") if scheme == "s3" else "the store"
        return f"the endpoint does not answer ({endpoint}: {text})"
    if isinstance(e, FileNotFoundError):
        return f"no such bucket or object ({text})"
    if any(_credentials_refused(c) for c in chain):
        where = "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws" if scheme == "s3" else \
            "GOOGLE_APPLICATION_CREDENTIALS or gcloud's application default credentials"
        return f"credentials refused ({text}): check {where}"
    return f"the store refused it ({text})"


def listing(key: str, url: str) -> list[Obj]:
    """The objects `url` names, sorted: every object under it where it is a prefix, the one object where it is
    one, those matching where it holds a glob (`s3://b/corpus/*.parquet`). None there: StorageError."""
    scheme, path = split(key, url)
    fs = fsspec_filesystem(key, url)
    glob_at = min((path.find(c) for c in GLOB_CHARS if c in path), default=-1)
    base = path if glob_at < 0 else path[:glob_at].rsplit("/", 1)[0]
    try:
        if "/" not in path.rstrip("/"):  # a bare bucket: its existence first, so a missing one says so
            fs.info(path)
        found = fs.find(base, detail=True, withdirs=False)
    except Exception as e:  # botocore's and gcsfs's errors arrive as OSError subclasses, or their own
        raise StorageError(key, url, refusal(e, scheme)) from None
    objs = [Obj(p, int(info.get("size") or 0), _version(info)) for p, info in found.items()]
    if glob_at >= 0:
        objs = [o for o in objs if fnmatch.fnmatchcase(o.path, path)]
    elif path.rstrip("/") not in {o.path for o in objs}:
        objs = [o for o in objs if o.path.startswith(path.rstrip("/") + "/")]
    if not objs:
        raise StorageError(key, url, "no such object: nothing there (no object at that key or under that prefix)")
    return sorted(objs, key=lambda o: o.path)


def _version(info: dict) -> str:
    """The object's version: its ETag (S3; GCS's etag or generation)."""
    return str(info.get("ETag") or info.get("etag") or info.get("generation") or info.get("md5Hash") or "").strip('"')


def download(key: str, url: str, obj: Obj, dest: str) -> None:
    """Copy object `obj` of `url`'s store to the local file `dest`, read through its pyarrow filesystem."""
    fs, _ = filesystem(key, url)
    try:
        with fs.open_input_stream(obj.path) as src, open(dest, "wb") as out:
            while chunk := src.read(1 << 22):
                out.write(chunk)
    except OSError as e:
        raise StorageError(key, url, f"{obj.path} cannot be read ({refusal(e, scheme_of(url) or 's3')})") from None
