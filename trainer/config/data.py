"""The `data` section: which corpus a run reads (`data=stdlib|parquet|chat|preference`), how it is split and
batched, and the Arrow Flight cache nodes that may serve its rows (`data.cache`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from omegaconf import MISSING

from datacache.server import MAX_READERS
from trainer.config.checks import one_of, read_by, require

# The data.cache keys naming the cache nodes that hold each split.
CACHE_KEYS = {"train": "endpoints", "eval": "eval_endpoints"}
FLIGHT_SCHEMES = ("grpc://", "grpc+tcp://", "grpc+tls://", "kubeflow+grpc://")  # the last: a Kubeflow cache's head


CACHE_BACKENDS = ("trainjob", "kubeflow")
@dataclass
class KubeflowCacheConfig:
    # data.cache.backend=kubeflow: what Kubeflow Trainer's dataset initializer (its CacheDatasetInitializer)
    # is given to start the cache over an Iceberg table; the resources are its head's and each data node's.
    storage_uri: str | None = None  # cache://<schema>/<table>
    metadata_loc: str | None = None  # the table's Iceberg metadata.json, e.g. s3a://bucket/path/metadata.json
    iam_role: str | None = None  # the role the cache reads the table with
    head_cpu: str = "1"  # the CPU of the cache's head pod
    head_mem: str = "1Gi"  # the memory of the cache's head pod
    worker_cpu: str = "2"  # the CPU of each data node pod
    worker_mem: str = "2Gi"  # the memory of each data node pod

    def check(self) -> None:
        uri = str(self.storage_uri or "")
        schema, _, table = uri.removeprefix("cache://").partition("/")
        require(uri.startswith("cache://") and bool(schema) and bool(table) and "/" not in table,
                "data.cache.kubeflow.storage_uri", self.storage_uri, "must be cache://<schema>/<table>, the table "
                "Kubeflow's cache serves")
        for key in ("metadata_loc", "iam_role"):
            require(bool(getattr(self, key)), f"data.cache.kubeflow.{key}", getattr(self, key),
                    "must be set for data.cache.backend=kubeflow (Kubeflow's dataset initializer needs it)")


@dataclass
class CacheConfig:
    # Arrow Flight cache nodes (`python -m datacache serve`) holding the training rows; empty: read the
    # corpus from disk in process.
    endpoints: list[str] = field(default_factory=list)
    # Cache nodes holding the eval rows; empty: the local corpus. With both lists set, no corpus is built
    # or read where the job runs.
    eval_endpoints: list[str] = field(default_factory=list)
    # Shared secret the nodes ask for. Never written: config.yaml, manifests and printed commands refer to
    # it as ${oc.env:TRAINJOB_CACHE_TOKEN}, and launchers hand it to the ranks in that variable.
    token: str | None = None
    prefetch: int = 32  # steps each rank reads ahead (datacache.StreamingDataset's prefetch)
    readers: int = 2  # threads each rank reads ahead with, each over its own connections (StreamingDataset's)
    # PEM file of the CA that signed grpc+tls nodes' certificates (a private CA); null: the system's.
    tls_root_cert: str | None = None
    # Cache nodes the launcher starts beside the ranks over this run's corpus (0: none); they replace
    # endpoints and eval_endpoints, and stop when the run ends.
    nodes: int = 0
    # Which cache data.cache.nodes are on Kubernetes: trainjob (a StatefulSet of ours over the run's corpus)
    # or kubeflow (Kubeflow Trainer's, on the torch-distributed-with-cache runtime: its dataset initializer
    # starts `nodes` data nodes over the table data.cache.kubeflow names; the ranks read the training rows
    # from its head through StreamingDataset, the eval rows from the local corpus).
    backend: str = "trainjob"
    kubeflow: KubeflowCacheConfig = field(default_factory=KubeflowCacheConfig)

    def check(self) -> None:
        require(self.prefetch >= 0, "data.cache.prefetch", self.prefetch, "must be >= 0 (0: no read-ahead thread)")
        require(1 <= self.readers <= MAX_READERS, "data.cache.readers", self.readers,
                f"must be 1 to {MAX_READERS} (read-ahead threads, each with a connection to every node)")
        for key in CACHE_KEYS.values():
            for i, endpoint in enumerate(getattr(self, key)):
                require(str(endpoint).startswith(FLIGHT_SCHEMES), f"data.cache.{key}[{i}]", endpoint,
                        "must be a Flight location such as grpc://host:50051 (or a Kubeflow cache's head, "
                        "kubeflow+grpc://<job>-cache-service:50051)")
        require(self.nodes >= 0, "data.cache.nodes", self.nodes, "must be >= 0 (0: start no cache nodes)")
        require(not (self.nodes and (self.endpoints or self.eval_endpoints)), "data.cache.nodes", self.nodes,
                "the run starts its own cache nodes: leave data.cache.endpoints and eval_endpoints empty")
        require(self.tls_root_cert is None or os.path.isfile(os.path.expanduser(self.tls_root_cert)),
                "data.cache.tls_root_cert", self.tls_root_cert, "must be a readable PEM file")
        one_of("data.cache.backend", self.backend, CACHE_BACKENDS)
        if self.backend == "kubeflow":
            require(self.nodes >= 1, "data.cache.nodes", self.nodes, "must be >= 1 with data.cache.backend=kubeflow: "
                    "the data nodes Kubeflow's dataset initializer starts")
            self.kubeflow.check()


DATASETS = ("stdlib", "parquet", "chat", "preference", "prompts")
CHAT_MASKS = ("assistant", "last", "all")
PACKINGS = ("padding_free", "longest", "max_length")


@dataclass
class ChatConfig:
    """data=chat and data=preference: which tokens of each rendered conversation the loss counts."""

    # assistant: every assistant turn (its content and end-of-turn token); last: the last assistant turn only;
    # all: every token. The turns come from the template's {% generation %} blocks, or message by message.
    mask: str = "assistant"

    def check(self) -> None:
        one_of("data.chat.mask", self.mask, CHAT_MASKS)


@dataclass
class DataConfig:
    # Each must be > 0 (`trainer.config.validate` checks it before `check()`).
    POSITIVE: ClassVar[tuple[str, ...]] = ("seq_len",)
    name: str = MISSING  # the option chosen: stdlib, parquet, chat, preference or prompts
    # Parquet files (a path, directory or glob) for `data=parquet`; unused by `stdlib`. A URL too (s3://b/c/*.parquet,
    # hf://datasets/<org>/<name>/<glob>: fetched once into the storage cache, docs/storage.md).
    path: str | None = read_by("parquet", "chat", "preference", "prompts", default=None)
    # data=parquet: the column of text to tokenize, or (with text_column=null) a column of token-id lists.
    text_column: str | None = read_by("parquet", default="text")
    tokens_column: str | None = read_by("parquet", default=None)
    seq_len: int = 256  # tokens per row (a training sequence; prompts: the longest prompt kept)
    # Unset (null): 2, and a run whose eval split is too small for a global batch trains without eval.
    eval_percent: float | None = None
    # Where corpora are tokenized and cached (built once, shared by runs).
    cache_dir: str = "${oc.env:TRAINJOB_CACHE,${oc.env:HOME}/.cache/trainjob}"
    shuffle: bool = True  # shuffle the training rows (a seeded order, kept across a resume)
    num_workers: int = 0  # DataLoader worker processes per rank (0: in the rank's own process)
    # How a micro-batch of data=chat or data=preference rows, or of data=prompts' prompts with their completions,
    # reaches the model: padding_free (TRL's: the rows' real tokens one after another in one row, positions
    # restarting and attention never crossing from one conversation to the next), longest (padded to the
    # micro-batch's longest row) or max_length (every row padded to data.seq_len; not data=prompts, whose rows
    # are as long as their completions). All give the same losses; null: padding_free, or max_length under
    # strategy.pp > 1, whose pipeline stages take one shape.
    packing: str | None = read_by("chat", "preference", "prompts", default=None)
    cache: CacheConfig = field(default_factory=CacheConfig)
    chat: ChatConfig = read_by("chat", "preference", default_factory=ChatConfig)
    # Set by the driver where it checked the corpus (launcher=local, docker): the key of the build its ranks
    # must read (`trainer.data.corpus.prepare`); a rank whose source would make another corpus refuses to start.
    fingerprint: str | None = None

    def check(self) -> None:
        one_of("data.name", self.name, DATASETS)
        self.chat.check()
        require(self.packing is None or self.packing in PACKINGS, "data.packing", self.packing,
                f"must be one of {', '.join(PACKINGS)} (padding_free carries no padding: what data.packing=true "
                "was for)")
        require(not (self.name == "prompts" and self.packing == "max_length"), "data.packing", self.packing,
                "data=prompts pads a prompt and its completion to the micro-batch's longest row at most: use "
                "padding_free (or leave it unset) or longest")
        require(self.eval_percent is None or 0 < self.eval_percent < 100, "data.eval_percent", self.eval_percent,
                "must be in (0, 100)")
        require(self.num_workers >= 0, "data.num_workers", self.num_workers, "must be >= 0")
        self.cache.check()
        if self.name == "parquet":
            require(bool(self.path), "data.path", self.path,
                    "data=parquet needs the Parquet files: a file, a directory or a glob")
            require(bool(self.text_column) != bool(self.tokens_column), "data.tokens_column", self.tokens_column,
                    "set exactly one of data.text_column and data.tokens_column")
