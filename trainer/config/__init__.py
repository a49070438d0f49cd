"""The config schema: one dataclass per config group, registered in Hydra's ConfigStore, and its checks.

The yaml files under `conf/` hold values only; types and defaults live here (Hydra rejects unknown keys
and wrong types while composing). Each section checks its own values in `check()`, next to its fields;
the few rules that span sections are in `_check_across`. `validate()` runs them all and returns the typed
`Config` (dataclasses, `OmegaConf.to_object`), which is what the worker trains from. Every rule raises
`ConfigError` naming the key, the value and what is allowed.

A new section is a dataclass with a `check()` method and a field of `Config`.
"""

from __future__ import annotations

import math
import os
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

import launchers
from datacache.server import MAX_READERS
from launchers import LAUNCHER_SCHEMAS, SchedulerConfig
from trainer import tracking
from trainer.config import peft as peft_config
from trainer.config import recipe as recipe_config
from trainer.config.errors import ConfigError
from trainer.config.peft import PeftConfig
from trainer.config.recipe import RecipeConfig
from trainer.run_dir import RunDir


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, key, value, f"must be one of {', '.join(allowed)}")


def _positive(section: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(value is not None and value > 0, f"{prefix}.{name}", value, "must be > 0")


# Precision names: "auto" is bf16 on CUDA and fp32 elsewhere (mixed_precision, param_dtype).
AUTO = "auto"
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DTYPES = tuple(TORCH_DTYPES)


def torch_dtype(name: str, device_type: str):
    """The torch dtype for a precision name of this config, `auto` resolved for `device_type`."""
    import torch

    if name == AUTO:
        name = "bf16" if device_type == "cuda" else "fp32"
    return getattr(torch, TORCH_DTYPES[name])


@dataclass
class ModelConfig:
    name: str = MISSING
    # model=hf: a Hugging Face model directory; the keys below are then read from its config.json.
    path: str | None = None
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = MISSING
    ffn_dim: int = MISSING
    vocab_size: int = 259
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def check(self) -> None:
        _positive(self, "model", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                  "max_seq_len", "rope_theta", "norm_eps", "init_std")
        _require(self.dim % self.n_heads == 0, "model.dim", self.dim,
                 f"must be divisible by model.n_heads={self.n_heads}")
        _require((self.dim // self.n_heads) % 2 == 0, "model.dim", self.dim,
                 f"model.dim / model.n_heads must be even for rotary embeddings (is {self.dim / self.n_heads:g})")
        _require(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
                 f"must divide model.n_heads={self.n_heads}")


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
    head_cpu: str = "1"
    head_mem: str = "1Gi"
    worker_cpu: str = "2"
    worker_mem: str = "2Gi"

    def check(self) -> None:
        uri = str(self.storage_uri or "")
        schema, _, table = uri.removeprefix("cache://").partition("/")
        _require(uri.startswith("cache://") and bool(schema) and bool(table) and "/" not in table,
                 "data.cache.kubeflow.storage_uri", self.storage_uri, "must be cache://<schema>/<table>, the table "
                 "Kubeflow's cache serves")
        for key in ("metadata_loc", "iam_role"):
            _require(bool(getattr(self, key)), f"data.cache.kubeflow.{key}", getattr(self, key),
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
        _require(self.prefetch >= 0, "data.cache.prefetch", self.prefetch, "must be >= 0 (0: no read-ahead thread)")
        _require(1 <= self.readers <= MAX_READERS, "data.cache.readers", self.readers,
                 f"must be 1 to {MAX_READERS} (read-ahead threads, each with a connection to every node)")
        for key in CACHE_KEYS.values():
            for i, endpoint in enumerate(getattr(self, key)):
                _require(str(endpoint).startswith(FLIGHT_SCHEMES), f"data.cache.{key}[{i}]", endpoint,
                         "must be a Flight location such as grpc://host:50051 (or a Kubeflow cache's head, "
                         "kubeflow+grpc://<job>-cache-service:50051)")
        _require(self.nodes >= 0, "data.cache.nodes", self.nodes, "must be >= 0 (0: start no cache nodes)")
        _require(not (self.nodes and (self.endpoints or self.eval_endpoints)), "data.cache.nodes", self.nodes,
                 "the run starts its own cache nodes: leave data.cache.endpoints and eval_endpoints empty")
        _require(self.tls_root_cert is None or os.path.isfile(os.path.expanduser(self.tls_root_cert)),
                 "data.cache.tls_root_cert", self.tls_root_cert, "must be a readable PEM file")
        _one_of("data.cache.backend", self.backend, CACHE_BACKENDS)
        if self.backend == "kubeflow":
            _require(self.nodes >= 1, "data.cache.nodes", self.nodes, "must be >= 1 with data.cache.backend=kubeflow: "
                     "the data nodes Kubeflow's dataset initializer starts")
            self.kubeflow.check()


DATASETS = ("stdlib", "parquet", "chat", "preference")
CHAT_MASKS = ("assistant", "last", "all")


@dataclass
class ChatConfig:
    """data=chat and data=preference: which tokens of each rendered conversation the loss counts."""

    # assistant: every assistant turn (its content and end-of-turn token); last: the last assistant turn only;
    # all: every token. The turns come from the template's {% generation %} blocks, or message by message.
    mask: str = "assistant"

    def check(self) -> None:
        _one_of("data.chat.mask", self.mask, CHAT_MASKS)


@dataclass
class DataConfig:
    name: str = MISSING
    # Parquet files (a path, directory or glob) for `data=parquet`; unused by `stdlib`.
    path: str | None = None
    text_column: str | None = "text"
    tokens_column: str | None = None
    seq_len: int = 256
    eval_percent: float = 2.0
    cache_dir: str = "${oc.env:TRAINJOB_CACHE,${oc.env:HOME}/.cache/trainjob}"
    shuffle: bool = True
    num_workers: int = 0
    # data=chat: pack conversations into rows (attention and positions within each) instead of padding each.
    packing: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    # Set by the driver where it checked the corpus (launcher=local, docker): the key of the build its ranks
    # must read (`trainer.data.prepare`); a rank whose source would make another corpus refuses to start.
    fingerprint: str | None = None

    def check(self) -> None:
        _one_of("data.name", self.name, DATASETS)
        self.chat.check()
        _positive(self, "data", "seq_len")
        _require(0 < self.eval_percent < 100, "data.eval_percent", self.eval_percent, "must be in (0, 100)")
        _require(self.num_workers >= 0, "data.num_workers", self.num_workers, "must be >= 0")
        self.cache.check()
        if self.name == "parquet":
            _require(bool(self.path), "data.path", self.path,
                     "data=parquet needs the Parquet files: a file, a directory or a glob")
            _require(bool(self.text_column) != bool(self.tokens_column), "data.tokens_column", self.tokens_column,
                     "set exactly one of data.text_column and data.tokens_column")


AC_MODES = ("none", "full", "selective")
DATA_PARALLEL = ("fsdp", "ddp")


@dataclass
class StrategyConfig:
    """How the model is spread over the ranks: the degrees of the DeviceMesh and the options of what they
    apply (`trainer.parallel.parallelize`). The yaml files under conf/strategy are presets of these."""

    name: str = MISSING  # the preset's name, as reported; what runs follows from the values below
    # Degrees of the DeviceMesh; one of them may be -1: the rest of the world. tp > 1: tensor parallelism.
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    # How data-parallel ranks hold the model: fsdp (FSDP2 over dp_shard, HSDP over dp_replicate x dp_shard)
    # or ddp (a whole, plain copy per rank: DistributedDataParallel over dp_replicate; no dp_shard, no tp).
    data_parallel: str = "fsdp"
    # ddp
    bucket_cap_mb: int = 25
    # fsdp (auto: bf16 parameters on CUDA, fp32 on CPU; gradients reduced in reduce_dtype)
    reshard_after_forward: bool = True
    param_dtype: str = AUTO
    reduce_dtype: str = "fp32"
    # tp: the loss computed on vocabulary shards (the logits never gathered) when the vocabulary divides
    loss_parallel: bool = True
    # all: none | full | selective (save matmul and attention outputs, recompute the rest)
    activation_checkpointing: str = "none"
    compile: bool = False

    def check(self) -> None:
        _one_of("strategy.data_parallel", self.data_parallel, DATA_PARALLEL)
        _one_of("strategy.activation_checkpointing", self.activation_checkpointing, AC_MODES)
        _one_of("strategy.param_dtype", self.param_dtype, (AUTO, *DTYPES))
        _one_of("strategy.reduce_dtype", self.reduce_dtype, DTYPES)
        _positive(self, "strategy", "bucket_cap_mb")
        if self.data_parallel == "ddp":
            for name in ("dp_shard", "tp"):
                _require(getattr(self, name) == 1, f"strategy.{name}", getattr(self, name),
                         f"strategy={self.name} uses only strategy.dp_replicate; this must be 1 "
                         "(strategy.data_parallel=ddp keeps a whole, plain copy of the model on every rank)")


RUNTIMES = ("torch-distributed",)


@dataclass
class RuntimeConfig:
    name: str = MISSING
    # null: the GPU count on this machine, or 2 without GPUs.
    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    max_restarts: int = 0
    rdzv_backend: str = "c10d"
    # host:port of node 0; null on one node lets torchrun pick a free local port (--standalone).
    rdzv_endpoint: str | None = None
    rdzv_id: str = "trainjob"
    monitor_interval: float = 1.0

    def check(self) -> None:
        _one_of("runtime.name", self.name, RUNTIMES)
        _require(self.nproc_per_node is None or self.nproc_per_node > 0, "runtime.nproc_per_node",
                 self.nproc_per_node, "must be > 0, or null for one process per GPU (2 without GPUs)")
        _positive(self, "runtime", "nnodes")
        _require(0 <= self.node_rank < self.nnodes, "runtime.node_rank", self.node_rank,
                 f"must be in [0, runtime.nnodes={self.nnodes})")
        _require(self.max_restarts >= 0, "runtime.max_restarts", self.max_restarts, "must be >= 0")
        _positive(self, "runtime", "monitor_interval")


KERNELS = ("torch", "triton")
# The model functions `kernels=triton` can route to ops/ (trainer/kernels.py applies them).
TRITON_OPS = ("rms_norm", "rotary_embedding", "scaled_dot_product_attention", "silu_and_mul",
              "fused_linear_cross_entropy")


@dataclass
class KernelsConfig:
    name: str = MISSING
    # triton: which of TRITON_OPS to use (null: all), and which to leave to PyTorch.
    include: list[str] | None = None
    exclude: list[str] = field(default_factory=list)

    def check(self) -> None:
        _one_of("kernels.name", self.name, KERNELS)
        for key in ("include", "exclude"):
            for op in getattr(self, key) or []:
                _require(op in TRITON_OPS, f"kernels.{key}", list(getattr(self, key)),
                         f"ops are {', '.join(TRITON_OPS)}")
        if self.name == "triton":
            try:
                import triton  # noqa: F401
            except ImportError:
                _require(False, "kernels", "triton", "needs the triton package: pip install triton")


OPTIMIZERS = ("adamw", "sgd")


@dataclass
class OptimConfig:
    name: str = MISSING
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    momentum: float = 0.9
    grad_clip: float | None = 1.0

    def check(self) -> None:
        _one_of("optim.name", self.name, OPTIMIZERS)
        _positive(self, "optim", "lr", "eps")
        _require(self.momentum >= 0, "optim.momentum", self.momentum, "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", list(self.betas),
                 "must be two numbers in [0, 1)")
        _require(self.grad_clip is None or self.grad_clip > 0, "optim.grad_clip", self.grad_clip,
                 "must be > 0, or null for no clipping")


@dataclass
class TrainConfig:
    seed: int = 0
    max_steps: int = 200
    global_batch_size: int = 16
    grad_accum_steps: int = 1
    # auto: bf16 autocast on CUDA, fp32 on CPU.
    mixed_precision: str = AUTO
    # Steps between metrics lines (TorchTitan's default); only a line waits for the device.
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_latest_k: int = 2
    # auto: resume from the latest checkpoint in run_dir; never: start fresh; or a checkpoint path.
    resume: str = "auto"
    progress: bool = True
    # Seconds between SIGTERM (preemption, docker stop) and SIGKILL, for the step in flight and a checkpoint:
    # the pods' terminationGracePeriodSeconds on Kubernetes, docker stop's timeout on Docker.
    preemption_grace_s: int = 30
    # Where metrics lines go besides metrics.jsonl (tensorboard, mlflow, wandb), and their settings.
    trackers: list[str] = field(default_factory=lambda: ["jsonl"])
    mlflow: tracking.MlflowConfig = field(default_factory=tracking.MlflowConfig)
    wandb: tracking.WandbConfig = field(default_factory=tracking.WandbConfig)

    def check(self) -> None:
        _one_of("train.mixed_precision", self.mixed_precision, (AUTO, *DTYPES))
        _require(0 <= self.seed < 2**32, "train.seed", self.seed, "must be in [0, 2**32)")
        _positive(self, "train", "max_steps", "global_batch_size", "grad_accum_steps", "log_every", "eval_every",
                  "eval_batches", "checkpoint_every", "keep_latest_k", "preemption_grace_s")
        if self.resume not in ("auto", "never"):
            _require(os.path.isfile(os.path.join(self.resume, ".metadata")), "train.resume", self.resume,
                     "must be auto, never, or a checkpoint directory (such as <run_dir>/checkpoints/step-100, "
                     "which holds a .metadata file)")


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    strategy: StrategyConfig = MISSING
    # Each launcher option has its own schema (launchers.LAUNCHER_SCHEMAS), named in its yaml's defaults list.
    launcher: Any = MISSING
    scheduler: SchedulerConfig = MISSING
    kernels: KernelsConfig = MISSING
    optim: OptimConfig = MISSING
    train: TrainConfig = MISSING
    recipe: RecipeConfig = MISSING
    peft: PeftConfig = MISSING
    runtime: RuntimeConfig | None = None
    run_dir: str = "${hydra:runtime.output_dir}"


LAUNCHERS = tuple(LAUNCHER_SCHEMAS)


def _kind(hint: Any) -> Any:
    """The one type a field holds (`X | None` gives X), or None for a union of several."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [k for k in (typing.get_args(hint) if union else (hint,)) if k is not type(None)]
    return kinds[0] if len(kinds) == 1 else None


# The schema of each section with one (all but the launcher, whose schema depends on its name).
SCHEMAS = {name: _kind(hint) for name, hint in typing.get_type_hints(Config).items() if is_dataclass(_kind(hint))}


def register() -> None:
    """Put the schemas into Hydra's ConfigStore; `conf/config.yaml` starts its defaults with `schema`."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for name, schema in LAUNCHER_SCHEMAS.items():
        cs.store(name=f"launcher_schema_{name}", node=schema)  # not a launcher option: no group


def numeric_keys(schema: type, prefix: str) -> list[tuple[str, type]]:
    """(dotted key, int or float) for every number-valued field of `schema` (a dataclass), nested ones too."""
    keys = []
    for name, hint in typing.get_type_hints(schema).items():
        kind = _kind(hint)
        if kind in (int, float):
            keys.append((f"{prefix}.{name}", kind))
        elif is_dataclass(kind):
            keys.extend(numeric_keys(kind, f"{prefix}.{name}"))
    return keys


def schemas(cfg: DictConfig) -> dict[str, type]:
    """The schema of each section of `cfg`, the chosen launcher's included."""
    chosen = dict(SCHEMAS)
    if cfg.launcher.get("name") in LAUNCHER_SCHEMAS:
        chosen["launcher"] = LAUNCHER_SCHEMAS[cfg.launcher.name]
    return chosen


def typed(cfg: DictConfig | dict) -> Config:
    """`cfg` (composed, or a resolved config.yaml as loaded) as the typed `Config` of dataclasses, resolved."""
    node = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    launcher = LAUNCHER_SCHEMAS.get(node.launcher.get("name"))
    if launcher is not None:  # `launcher: Any` in the schema: type it by its name
        node.launcher = OmegaConf.merge(OmegaConf.structured(launcher), node.launcher)
    try:
        return OmegaConf.to_object(node)
    except MissingMandatoryValue as e:
        raise ConfigError(e.full_key, "???", "must be set") from None


def local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def node_gpus(cfg: Config | DictConfig) -> int:
    """GPUs per node: those a remote launcher asks for, or those on this machine for the local one."""
    name = cfg.launcher.name
    if name == "kubernetes":
        return int(cfg.launcher.resources_per_node.gpu)
    if name == "docker":
        return int(cfg.launcher.gpus_per_node)
    return local_gpu_count()


def nproc_per_node(cfg: Config | DictConfig) -> int:
    """Processes per node: the runtime's setting, else one per GPU; without GPUs, 2 on this machine and 1
    on a remote node (whose cores the launcher does not know)."""
    if cfg.runtime is None:
        return 1
    if cfg.runtime.nproc_per_node is not None:
        return int(cfg.runtime.nproc_per_node)
    return node_gpus(cfg) or (2 if cfg.launcher.name == "local" else 1)


def world_size(cfg: Config | DictConfig) -> int:
    return 1 if cfg.runtime is None else nproc_per_node(cfg) * int(cfg.runtime.nnodes)


def parallel_dims(cfg: Config | DictConfig, world: int | None = None):
    """The checked and filled `trainer.parallel.ParallelDims` of `cfg` for `world` ranks (default: the
    config's world size)."""
    from trainer.parallel.dims import ParallelDims  # it imports torch only to build a mesh

    return ParallelDims.from_config(cfg.strategy, world_size(cfg) if world is None else world)


def mesh_degrees(strategy: StrategyConfig | DictConfig, world: int) -> dict[str, int]:
    """The strategy's (dp_replicate, dp_shard, tp) degrees for `world` ranks, the -1 filled in."""
    from trainer.parallel.dims import ParallelDims

    return ParallelDims.from_config(strategy, world).degrees()


def dp_size(cfg: Config | DictConfig) -> int:
    """How many ranks see different data: the data-parallel degrees (tensor-parallel peers share batches)."""
    return parallel_dims(cfg).dp_size


def _known_keys(cfg: DictConfig) -> None:
    # Hydra's `+key=value` appends keys even to a typed node; only the schema's fields are meaningful.
    top = {f.name for f in fields(Config)}
    for key in cfg:
        _require(key in top, str(key), cfg.get(key), f"unknown key; the top level has {', '.join(sorted(top))}")
    for group, schema in schemas(cfg).items():
        node = cfg.get(group)
        if node is None:
            continue
        known = {f.name for f in fields(schema)}
        for key in node:
            _require(key in known, f"{group}.{key}", node.get(key),
                     f"unknown key; {group} has {', '.join(sorted(known))}")


def _finite(section: Any, prefix: str) -> None:
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            _finite(value, f"{prefix}.{f.name}")
        elif isinstance(value, float):
            _require(math.isfinite(value), f"{prefix}.{f.name}", value, "must be a finite number")
        elif isinstance(value, int) and not isinstance(value, bool):
            _require(-(2**63) <= value < 2**63, f"{prefix}.{f.name}", value, "must be within a 64-bit integer")


def _validate_launcher(cfg: DictConfig) -> None:
    """The launcher's and the scheduler's own rules (`launchers.check`), reported as config errors."""
    nnodes = int(cfg.runtime.nnodes) if cfg.get("runtime") is not None else None
    paths = {"hydra.run.dir": os.path.abspath(os.path.expanduser(str(cfg.run_dir))),
             "data.cache_dir": os.path.abspath(os.path.expanduser(str(cfg.data.cache_dir)))}
    try:
        launchers.check(cfg.launcher, cfg.scheduler, nnodes, paths)
    except launchers.OptionError as e:
        raise ConfigError(e.key, e.value, e.allowed) from None


def _check_across(job: Config) -> None:
    """The rules that span sections."""
    m, s, t = job.model, job.strategy, job.train
    from trainer.models.tokenizer import VOCAB_SIZE

    # Chat and preference data are tokenized by the model directory's tokenizer, the rest byte by byte.
    _require(job.data.name in ("chat", "preference") or m.vocab_size >= VOCAB_SIZE, "model.vocab_size",
             m.vocab_size, f"must be >= {VOCAB_SIZE}, the byte-level tokenizer's vocabulary")
    _require(job.data.seq_len <= m.max_seq_len, "data.seq_len", job.data.seq_len,
             f"must be <= model.max_seq_len={m.max_seq_len}")
    _require(job.data.cache.backend != "kubeflow" or job.launcher.name == "kubernetes", "data.cache.backend",
             job.data.cache.backend, f"Kubeflow Trainer's cache runs on Kubernetes: give launcher=kubernetes (not "
             f"{job.launcher.name}), or data.cache.backend=trainjob")
    r = job.runtime
    if r is not None:  # remote launchers know node 0's address (Kubeflow injects it; Docker names the container)
        _require(r.nnodes == 1 or bool(r.rdzv_endpoint) or job.launcher.name != "local", "runtime.rdzv_endpoint",
                 r.rdzv_endpoint, "must be host:port of node 0 when runtime.nnodes > 1")
        gpus = local_gpu_count() if job.launcher.name == "local" else 0
        _require(gpus == 0 or nproc_per_node(job) <= gpus, "runtime.nproc_per_node", nproc_per_node(job),
                 f"must be <= {gpus}, the GPUs on this machine (each rank takes one)")
    world = world_size(job)
    _require(s.tp == 1 or world > 1, "strategy", s.name, f"strategy={s.name} needs more than one process: add "
             f"+runtime=torch-distributed (world size is {world})")
    dims = parallel_dims(job, world)
    if dims.tp > 1:
        for key in ("n_heads", "n_kv_heads", "dim", "ffn_dim"):
            _require(getattr(m, key) % dims.tp == 0, f"model.{key}", getattr(m, key),
                     f"must be divisible by the tensor-parallel degree strategy.tp={dims.tp}")
    if job.kernels.name == "triton":
        _require(job.launcher.name != "local" or local_gpu_count() > 0 or os.environ.get("TRITON_INTERPRET") == "1",
                 "kernels", "triton",
                 "needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on the CPU (slowly, for testing)")
        _require(dims.tp == 1, "kernels", "triton", f"works with strategy=ddp or fsdp2 (strategy.tp=1); "
                 f"strategy={s.name} hands the kernels DTensors")
    recipe_config.check(job)
    peft_config.check(job)
    per_step = dims.dp_size * t.grad_accum_steps
    tracking.check(job)
    _require(t.global_batch_size % per_step == 0, "train.global_batch_size", t.global_batch_size,
             f"must be divisible by data-parallel size x train.grad_accum_steps = {dims.dp_size} x "
             f"{t.grad_accum_steps} = {per_step}")
    if t.resume == "never":
        ckpt = RunDir(job.run_dir).checkpoints
        _require(not (os.path.isdir(ckpt) and os.listdir(ckpt)), "train.resume", t.resume,
                 f"{ckpt} already holds checkpoints that a fresh run would overwrite: use train.resume=auto "
                 "or another run directory")


def validate(cfg: DictConfig) -> Config:
    """Check every rule that the types alone cannot; raise ConfigError on the first one broken. Returns the
    typed config."""
    _known_keys(cfg)
    _one_of("launcher.name", cfg.launcher.name, LAUNCHERS)
    job = typed(cfg)
    sections = {name: getattr(job, name) for name in schemas(cfg) if getattr(job, name) is not None}
    for name, section in sections.items():
        _finite(section, name)
    for section in sections.values():
        if hasattr(section, "check"):  # the launcher's and scheduler's rules live in launchers/
            section.check()
    _validate_launcher(cfg)
    _check_across(job)
    return job
