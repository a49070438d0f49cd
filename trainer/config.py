"""The config schema: one dataclass per config group, registered in Hydra's ConfigStore, and the checks.

The yaml files under `conf/` hold values only; types and defaults live here (Hydra rejects unknown keys
and wrong types while composing), and `validate()` holds every rule that spans values or keys. Each
rule raises `ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from trainer import tracking


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}: {allowed}")


@dataclass
class ModelConfig:
    name: str = MISSING
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


# The data.cache keys naming the cache nodes that hold each split.
CACHE_KEYS = {"train": "endpoints", "eval": "eval_endpoints"}


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
    prefetch: int = 8  # steps each rank reads ahead (datacache.StreamingDataset's prefetch)
    # PEM file of the CA that signed grpc+tls nodes' certificates (a private CA); null: the system's.
    tls_root_cert: str | None = None
    # Cache nodes the launcher starts beside the ranks over this run's corpus (0: none); they replace
    # endpoints and eval_endpoints, and stop when the run ends.
    nodes: int = 0


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
    cache: CacheConfig = field(default_factory=CacheConfig)


@dataclass
class StrategyConfig:
    name: str = MISSING
    # Degrees of the DeviceMesh (dp_replicate, dp_shard, tp); one of them may be -1: the rest of the world.
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    # ddp
    bucket_cap_mb: int = 25
    # fsdp2 (auto: bf16 parameters on CUDA, fp32 on CPU; gradients reduced in reduce_dtype)
    reshard_after_forward: bool = True
    param_dtype: str = "auto"
    reduce_dtype: str = "fp32"
    # tp: the loss computed on vocabulary shards (the logits never gathered) when the vocabulary divides
    loss_parallel: bool = True
    # all: none | full | selective (save matmul and attention outputs, recompute the rest)
    activation_checkpointing: str = "none"
    compile: bool = False


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


@dataclass
class LocalLauncherConfig:
    name: str = "local"


@dataclass
class Resources:
    cpu: str | None = None
    memory: str | None = None
    gpu: int = 0


@dataclass
class DockerLauncherConfig:
    name: str = "docker"
    image: str = MISSING
    network: str | None = None  # null: one per job, named after it
    gpus_per_node: int = 0
    shm_size: str = "8g"
    env: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False
    wait: bool = True


@dataclass
class Volume:
    name: str = MISSING
    claim: str = MISSING  # a PersistentVolumeClaim in the job's namespace
    mount_path: str = MISSING
    read_only: bool = False


@dataclass
class KubernetesLauncherConfig:
    name: str = "kubernetes"
    image: str = MISSING
    namespace: str = "default"
    context: str | None = None
    kubeconfig: str | None = None  # null: $KUBECONFIG or ~/.kube/config, else the in-cluster config
    # The ClusterTrainingRuntime to run on; null: the runtime's name (torch-distributed).
    runtime_ref: str | None = None
    job_name: str | None = None  # null: derived from the run directory's name, plus a unique suffix
    resources_per_node: Resources = field(default_factory=Resources)
    env: dict[str, str] = field(default_factory=dict)
    active_deadline_seconds: int | None = None
    suspend: bool = False
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[Volume] = field(default_factory=list)
    service_account: str | None = None
    # Where the run directory lives in the pods: under run_root, on the claim run_claim when it is set
    # (shared storage), else on each pod's own disk. local_run_root: the same storage as this machine
    # mounts it, so that `wait=true` can read each run's summary.json.
    run_root: str = "/workspace/runs"
    run_claim: str | None = None
    local_run_root: str | None = None
    cache_dir: str = "/workspace/cache"
    dry_run: bool = False
    wait: bool = False
    poll_seconds: float = 10.0


@dataclass
class SchedulerConfig:
    name: str = MISSING
    queue: str | None = None
    priority_class: str | None = None
    schedule_timeout_seconds: int | None = None


@dataclass
class KernelsConfig:
    name: str = MISSING
    # triton: which of rms_norm, rotary_embedding, silu_and_mul, fused_linear_cross_entropy to use
    # (null: all), and which to leave to PyTorch.
    include: list[str] | None = None
    exclude: list[str] = field(default_factory=list)


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


@dataclass
class TrainConfig:
    seed: int = 0
    max_steps: int = 200
    global_batch_size: int = 16
    grad_accum_steps: int = 1
    # auto: bf16 autocast on CUDA, fp32 on CPU.
    mixed_precision: str = "auto"
    # Steps between metrics lines (TorchTitan's default); only a line waits for the device.
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_latest_k: int = 2
    # auto: resume from the latest checkpoint in run_dir; never: start fresh; or a checkpoint path.
    resume: str = "auto"
    progress: bool = True
    # Where metrics lines go besides metrics.jsonl (tensorboard, mlflow, wandb), and their settings.
    trackers: list[str] = field(default_factory=lambda: ["jsonl"])
    mlflow: tracking.MlflowConfig = field(default_factory=tracking.MlflowConfig)
    wandb: tracking.WandbConfig = field(default_factory=tracking.WandbConfig)


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    strategy: StrategyConfig = MISSING
    # Each launcher option has its own schema (LAUNCHER_SCHEMAS), named in its yaml's defaults list.
    launcher: Any = MISSING
    scheduler: SchedulerConfig = MISSING
    kernels: KernelsConfig = MISSING
    optim: OptimConfig = MISSING
    train: TrainConfig = MISSING
    runtime: RuntimeConfig | None = None
    run_dir: str = "${hydra:runtime.output_dir}"


LAUNCHER_SCHEMAS = {
    "local": LocalLauncherConfig,
    "docker": DockerLauncherConfig,
    "kubernetes": KubernetesLauncherConfig,
}

SCHEMAS = {
    "model": ModelConfig,
    "data": DataConfig,
    "strategy": StrategyConfig,
    "runtime": RuntimeConfig,
    "scheduler": SchedulerConfig,
    "kernels": KernelsConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
}


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
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = [k for k in (typing.get_args(hint) if union else (hint,)) if k is not type(None)]
        if len(kinds) == 1 and kinds[0] in (int, float):
            keys.append((f"{prefix}.{name}", kinds[0]))
        elif len(kinds) == 1 and is_dataclass(kinds[0]):
            keys.extend(numeric_keys(kinds[0], f"{prefix}.{name}"))
    return keys


def schemas(cfg: DictConfig) -> dict[str, type]:
    """The schema of each section of `cfg`, the chosen launcher's included."""
    chosen = dict(SCHEMAS)
    if cfg.launcher.get("name") in LAUNCHER_SCHEMAS:
        chosen["launcher"] = LAUNCHER_SCHEMAS[cfg.launcher.name]
    return chosen


def _finite(cfg: DictConfig) -> None:
    for group, schema in schemas(cfg).items():
        if cfg.get(group) is None:
            continue
        for key, kind in numeric_keys(schema, group):
            value = OmegaConf.select(cfg, key)
            _require(kind is int or value is None or math.isfinite(value), key, value, "must be a finite number")


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def _one_of(cfg: DictConfig, key: str, allowed: tuple[str, ...]) -> None:
    value = OmegaConf.select(cfg, key)
    _require(value in allowed, key, value, f"must be one of {', '.join(allowed)}")


def _positive(cfg: DictConfig, *keys: str) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        _require(value is not None and value > 0, key, value, "must be > 0")


def local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def node_gpus(cfg: DictConfig) -> int:
    """GPUs per node: those a remote launcher asks for, or those on this machine for the local one."""
    name = cfg.launcher.name
    if name == "kubernetes":
        return int(cfg.launcher.resources_per_node.gpu)
    if name == "docker":
        return int(cfg.launcher.gpus_per_node)
    return local_gpu_count()


def nproc_per_node(cfg: DictConfig) -> int:
    """Processes per node: the runtime's setting, else one per GPU; without GPUs, 2 on this machine and 1
    on a remote node (whose cores the launcher does not know)."""
    if cfg.get("runtime") is None:
        return 1
    if cfg.runtime.nproc_per_node is not None:
        return int(cfg.runtime.nproc_per_node)
    return node_gpus(cfg) or (2 if cfg.launcher.name == "local" else 1)


def world_size(cfg: DictConfig) -> int:
    if cfg.get("runtime") is None:
        return 1
    return nproc_per_node(cfg) * int(cfg.runtime.nnodes)


DEGREES = ("dp_replicate", "dp_shard", "tp")


def mesh_degrees(strategy: DictConfig, world: int) -> dict[str, int]:
    """The strategy's (dp_replicate, dp_shard, tp) degrees for `world` ranks, the -1 filled in."""
    degrees = {d: int(strategy[d]) for d in DEGREES}
    for d, v in degrees.items():
        _require(v == -1 or v >= 1, f"strategy.{d}", v, "must be >= 1, or -1 for the rest of the world")
    rest = [d for d, v in degrees.items() if v == -1]
    _require(len(rest) <= 1, f"strategy.{rest[-1] if rest else 'tp'}", -1,
             f"only one of {', '.join('strategy.' + d for d in DEGREES)} may be -1")
    known = 1
    for v in degrees.values():
        known *= v if v != -1 else 1
    if rest:
        _require(world % known == 0, f"strategy.{rest[0]}", -1,
                 f"the other degrees multiply to {known}, which does not divide the world size {world}")
        degrees[rest[0]] = world // known
    product = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"]
    _require(product == world, "strategy", {d: strategy[d] for d in DEGREES},
             f"dp_replicate x dp_shard x tp = {product} must equal the world size {world}")
    return degrees


def dp_size(cfg: DictConfig) -> int:
    """How many ranks see different data: the data-parallel degrees (tensor-parallel peers share batches)."""
    d = mesh_degrees(cfg.strategy, world_size(cfg))
    return d["dp_replicate"] * d["dp_shard"]


STRATEGIES = ("ddp", "fsdp2", "tp", "fsdp2_tp")
AC_MODES = ("none", "full", "selective")
DTYPES = ("auto", "fp32", "bf16")
LAUNCHERS = tuple(LAUNCHER_SCHEMAS)
SCHEDULERS = ("none", "kueue", "volcano", "coscheduling", "kai")
KERNELS = ("torch", "triton")
TRITON_OPS = ("rms_norm", "rotary_embedding", "silu_and_mul", "fused_linear_cross_entropy")
OPTIMIZERS = ("adamw", "sgd")
DATASETS = ("stdlib", "parquet")
RUNTIMES = ("torch-distributed",)
PRECISIONS = ("auto", "fp32", "bf16")


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


def _validate_layout(cfg: DictConfig, world: int) -> None:
    s, m = cfg.strategy, cfg.model
    if s.name in ("tp", "fsdp2_tp"):
        _require(world > 1, "strategy", s.name,
                 f"strategy={s.name} needs more than one process: add +runtime=torch-distributed "
                 f"(world size is {world})")
    d = mesh_degrees(s, world)
    expected = {"ddp": ("dp_replicate",), "fsdp2": ("dp_replicate", "dp_shard"), "tp": ("tp",),
                "fsdp2_tp": ("dp_replicate", "dp_shard", "tp")}[s.name]
    for name in DEGREES:
        _require(name in expected or d[name] == 1, f"strategy.{name}", s[name],
                 f"strategy={s.name} uses only {', '.join('strategy.' + e for e in expected)}; this must be 1")
    if s.name == "fsdp2_tp":
        _require(d["tp"] > 1, "strategy.tp", s.tp, "strategy=fsdp2_tp needs strategy.tp > 1 (else use fsdp2)")
    tp = d["tp"]
    if tp > 1:
        for key in ("n_heads", "n_kv_heads", "dim", "ffn_dim"):
            _require(m[key] % tp == 0, f"model.{key}", m[key],
                     f"must be divisible by the tensor-parallel degree strategy.tp={tp}")
        _require(not m.tie_embeddings, "model.tie_embeddings", True,
                 "tied embeddings cannot be tensor-parallel (the embedding is sharded by rows); set "
                 "model.tie_embeddings=false")


def _validate_kernels(cfg: DictConfig) -> None:
    k = cfg.kernels
    for key in ("include", "exclude"):
        for op in k.get(key) or []:
            _require(op in TRITON_OPS, f"kernels.{key}", list(k[key]), f"ops are {', '.join(TRITON_OPS)}")
    if k.name != "triton":
        return
    try:
        import triton  # noqa: F401
    except ImportError:
        _require(False, "kernels", "triton", "needs the triton package: pip install triton")
    if cfg.launcher.name == "local":
        _require(local_gpu_count() > 0 or os.environ.get("TRITON_INTERPRET") == "1", "kernels", "triton",
                 "needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on the CPU (slowly, for testing)")
    _require(cfg.strategy.name in ("ddp", "fsdp2"), "kernels", "triton",
             f"works with strategy=ddp or fsdp2; strategy={cfg.strategy.name} hands the kernels DTensors")


RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RFC1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _validate_launcher(cfg: DictConfig) -> None:
    lc, sc = cfg.launcher, cfg.scheduler
    remote = lc.name in ("docker", "kubernetes")
    if remote:
        _require(bool(lc.image) and not str(lc.image).startswith("-") and not any(ch.isspace() for ch in str(lc.image)),
                 "launcher.image", lc.image, f"launcher={lc.name} needs an image reference such as "
                 "'trainjob:latest' (no leading '-', no spaces)")
        _require(cfg.get("runtime") is not None, "runtime", None,
                 f"launcher={lc.name} runs torchrun on every node: add +runtime=torch-distributed")
    if lc.name == "docker":
        _require(lc.gpus_per_node >= 0, "launcher.gpus_per_node", lc.gpus_per_node, "must be >= 0")
        for key in ("run_dir", "data.cache_dir"):  # docker reads ':' in a --volume as its separator
            value = os.path.abspath(os.path.expanduser(str(OmegaConf.select(cfg, key))))
            _require(":" not in value, "hydra.run.dir" if key == "run_dir" else key, value,
                     "must not hold ':' with launcher=docker (docker's volume separator)")
    if lc.name == "kubernetes":
        _require(len(lc.namespace) <= 63 and bool(RFC1123.match(lc.namespace)), "launcher.namespace",
                 lc.namespace, "must be a DNS label: lower-case letters, digits and '-', at most 63 characters")
        if lc.job_name is not None:
            _require(len(lc.job_name) <= 52 and bool(RFC1035.match(lc.job_name)), "launcher.job_name",
                     lc.job_name, "must be an RFC 1035 label (a-z, 0-9, '-', starting with a letter) of at "
                     "most 52 characters, leaving room for the pods' suffixes")
        _require(lc.resources_per_node.gpu >= 0, "launcher.resources_per_node.gpu", lc.resources_per_node.gpu,
                 "must be >= 0")
        _positive(cfg, "launcher.poll_seconds")
        nnodes = cfg.runtime.nnodes if cfg.get("runtime") is not None else 1
        _require(nnodes == 1 or bool(lc.run_claim), "launcher.run_claim", lc.run_claim,
                 f"runtime.nnodes={nnodes} needs a shared PersistentVolumeClaim for the run directory: checkpoints "
                 "written on each pod's own disk cannot be resumed")
        _require(lc.active_deadline_seconds is None or lc.active_deadline_seconds > 0,
                 "launcher.active_deadline_seconds", lc.active_deadline_seconds, "must be > 0, or null")
        for key in lc.env:
            _require(not str(key).startswith("PET_"), f"launcher.env.{key}", lc.env[key],
                     "PET_* variables are set by the Kubeflow Trainer torch plugin; torchrun reads them")
        _require(lc.local_run_root is None or lc.run_claim is not None, "launcher.local_run_root",
                 lc.local_run_root, "is the shared run storage as this machine sees it: set launcher.run_claim too")
    if sc.name != "none":
        _require(lc.name == "kubernetes", "scheduler", sc.name,
                 f"gang schedulers run on Kubernetes: use launcher=kubernetes (launcher is {lc.name})")
    if sc.name in ("kueue", "kai"):
        _require(bool(sc.queue), "scheduler.queue", sc.queue, f"scheduler={sc.name} needs the queue to submit to")
    _require(sc.schedule_timeout_seconds is None or sc.schedule_timeout_seconds > 0,
             "scheduler.schedule_timeout_seconds", sc.schedule_timeout_seconds, "must be > 0, or null")


def validate(cfg: DictConfig) -> None:
    """Check every rule that the types alone cannot; raise ConfigError on the first one broken."""
    _known_keys(cfg)
    _finite(cfg)
    _one_of(cfg, "strategy.name", STRATEGIES)
    _one_of(cfg, "launcher.name", LAUNCHERS)
    _one_of(cfg, "scheduler.name", SCHEDULERS)
    _one_of(cfg, "kernels.name", KERNELS)
    _one_of(cfg, "optim.name", OPTIMIZERS)
    _one_of(cfg, "data.name", DATASETS)
    _one_of(cfg, "train.mixed_precision", PRECISIONS)
    _one_of(cfg, "strategy.activation_checkpointing", AC_MODES)
    _one_of(cfg, "strategy.param_dtype", DTYPES)
    _one_of(cfg, "strategy.reduce_dtype", DTYPES[1:])
    _positive(cfg, "strategy.bucket_cap_mb")

    m = cfg.model
    _positive(cfg, "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim")
    _positive(cfg, "model.vocab_size", "model.max_seq_len", "model.rope_theta", "model.norm_eps", "model.init_std")
    _require(m.dim % m.n_heads == 0, "model.dim", m.dim, f"must be divisible by model.n_heads={m.n_heads}")
    _require((m.dim // m.n_heads) % 2 == 0, "model.dim", m.dim,
             f"model.dim / model.n_heads must be even for rotary embeddings (is {m.dim / m.n_heads:g})")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
             f"must divide model.n_heads={m.n_heads}")
    from trainer.models.tokenizer import VOCAB_SIZE

    _require(m.vocab_size >= VOCAB_SIZE, "model.vocab_size", m.vocab_size,
             f"must be >= {VOCAB_SIZE}, the byte-level tokenizer's vocabulary")

    _positive(cfg, "data.seq_len")
    _require(cfg.data.seq_len <= m.max_seq_len, "data.seq_len", cfg.data.seq_len,
             f"must be <= model.max_seq_len={m.max_seq_len}")
    _require(0 < cfg.data.eval_percent < 100, "data.eval_percent", cfg.data.eval_percent,
             "must be in (0, 100)")
    _require(cfg.data.num_workers >= 0, "data.num_workers", cfg.data.num_workers, "must be >= 0")
    _require(cfg.data.cache.prefetch >= 0, "data.cache.prefetch", cfg.data.cache.prefetch,
             "must be >= 0 (0: no read-ahead thread)")
    c = cfg.data.cache
    for key in CACHE_KEYS.values():
        for i, endpoint in enumerate(c[key]):
            _require(str(endpoint).startswith(("grpc://", "grpc+tcp://", "grpc+tls://")),
                     f"data.cache.{key}[{i}]", endpoint, "must be a Flight location such as grpc://host:50051")
    _require(c.nodes >= 0, "data.cache.nodes", c.nodes, "must be >= 0 (0: start no cache nodes)")
    _require(not (c.nodes and (c.endpoints or c.eval_endpoints)), "data.cache.nodes", c.nodes,
             "the run starts its own cache nodes: leave data.cache.endpoints and eval_endpoints empty")
    _require(c.tls_root_cert is None or os.path.isfile(os.path.expanduser(c.tls_root_cert)),
             "data.cache.tls_root_cert", c.tls_root_cert, "must be a readable PEM file")
    if cfg.data.name == "parquet":
        _require(bool(cfg.data.path), "data.path", cfg.data.path,
                 "data=parquet needs the Parquet files: a file, a directory or a glob")
        _require(bool(cfg.data.text_column) != bool(cfg.data.tokens_column), "data.tokens_column",
                 cfg.data.tokens_column, "set exactly one of data.text_column and data.tokens_column")

    o = cfg.optim
    _positive(cfg, "optim.lr", "optim.eps")
    _require(o.momentum >= 0, "optim.momentum", o.momentum, "must be >= 0")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    _require(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", list(o.betas),
             "must be two numbers in [0, 1)")
    _require(o.grad_clip is None or o.grad_clip > 0, "optim.grad_clip", o.grad_clip,
             "must be > 0, or null for no clipping")

    t = cfg.train
    _require(0 <= t.seed < 2**32, "train.seed", t.seed, "must be in [0, 2**32)")
    _positive(cfg, "train.max_steps", "train.global_batch_size", "train.grad_accum_steps",
              "train.log_every", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
              "train.keep_latest_k")

    if cfg.get("runtime") is not None:
        r = cfg.runtime
        _one_of(cfg, "runtime.name", RUNTIMES)
        _require(r.nproc_per_node is None or r.nproc_per_node > 0, "runtime.nproc_per_node",
                 r.nproc_per_node, "must be > 0, or null for one process per GPU (2 without GPUs)")
        _positive(cfg, "runtime.nnodes")
        _require(0 <= r.node_rank < r.nnodes, "runtime.node_rank", r.node_rank,
                 f"must be in [0, runtime.nnodes={r.nnodes})")
        _require(r.max_restarts >= 0, "runtime.max_restarts", r.max_restarts, "must be >= 0")
        _positive(cfg, "runtime.monitor_interval")
        # Remote launchers know node 0's address (Kubeflow injects it; Docker names the container).
        _require(r.nnodes == 1 or bool(r.rdzv_endpoint) or cfg.launcher.name != "local", "runtime.rdzv_endpoint",
                 r.rdzv_endpoint, "must be host:port of node 0 when runtime.nnodes > 1")

    _validate_launcher(cfg)
    _validate_kernels(cfg)
    tracking.check(cfg)
    world = world_size(cfg)
    _validate_layout(cfg, world)
    dp = dp_size(cfg)
    per_step = dp * t.grad_accum_steps
    _require(t.global_batch_size % per_step == 0, "train.global_batch_size", t.global_batch_size,
             f"must be divisible by data-parallel size x train.grad_accum_steps = {dp} x {t.grad_accum_steps}"
             f" = {per_step}")

    if t.resume not in ("auto", "never"):
        _require(os.path.isfile(os.path.join(t.resume, ".metadata")), "train.resume", t.resume,
                 "must be auto, never, or a checkpoint directory (such as <run_dir>/checkpoints/step-100, "
                 "which holds a .metadata file)")
    if t.resume == "never":
        ckpt = os.path.join(cfg.run_dir, "checkpoints")
        _require(not (os.path.isdir(ckpt) and os.listdir(ckpt)), "train.resume", t.resume,
                 f"{ckpt} already holds checkpoints that a fresh run would overwrite: use train.resume=auto "
                 "or another run directory")
