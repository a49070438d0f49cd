"""The rules that span sections, all of them, in one place: `check(job)` over the typed config, after each
section has checked its own values. Each helper below holds the rules of one pair of concerns."""

from __future__ import annotations

import os

from trainer.config import runtime
from trainer.config.checks import require
from trainer.config.model import BYTE_VOCAB_SIZE
from trainer.config.recipe import DATA
from trainer.config.runtime import nproc_per_node, world_size
from trainer.config.strategy import Degrees
from trainer.config.train import require_tracker_package
from trainer.errors import ConfigError
from trainer.run_dir import RunDir


def check(job) -> None:
    """Raise ConfigError on the first rule across sections that `job` (the typed `Config`) breaks."""
    _model_and_data(job)
    _runtime(job)
    world = world_size(job)
    s = job.strategy
    require(s.tp == 1 or world > 1, "strategy", s.name, f"strategy={s.name} needs more than one process: add "
            f"+runtime=torch-distributed (world size is {world})")
    dims = Degrees.of(s, world)
    _parallel(job, dims)
    _recipe(job)
    _peft(job)
    _trackers(job)
    t = job.train
    per_step = dims.dp_size * t.grad_accum_steps
    require(t.global_batch_size % per_step == 0, "train.global_batch_size", t.global_batch_size,
            f"must be divisible by data-parallel size x train.grad_accum_steps = {dims.dp_size} x "
            f"{t.grad_accum_steps} = {per_step}")
    if t.resume == "never":
        ckpt = RunDir.of(job.run_dir).checkpoints
        require(not (os.path.isdir(ckpt) and os.listdir(ckpt)), "train.resume", t.resume,
                f"{ckpt} already holds checkpoints that a fresh run would overwrite: use train.resume=auto "
                "or another run directory")


def _model_and_data(job) -> None:
    m = job.model
    # Chat and preference data are tokenized by the model directory's tokenizer, the rest byte by byte.
    require(job.data.name in ("chat", "preference") or m.vocab_size >= BYTE_VOCAB_SIZE, "model.vocab_size",
            m.vocab_size, f"must be >= {BYTE_VOCAB_SIZE}, the byte-level tokenizer's vocabulary")
    require(job.data.seq_len <= m.max_seq_len, "data.seq_len", job.data.seq_len,
            f"must be <= model.max_seq_len={m.max_seq_len}")
    require(job.data.cache.backend != "kubeflow" or job.launcher.name == "kubernetes", "data.cache.backend",
            job.data.cache.backend, f"Kubeflow Trainer's cache runs on Kubernetes: give launcher=kubernetes (not "
            f"{job.launcher.name}), or data.cache.backend=trainjob")


def _runtime(job) -> None:
    r = job.runtime
    if r is not None:  # remote launchers know node 0's address (Kubeflow injects it; Docker names the container)
        require(r.nnodes == 1 or bool(r.rdzv_endpoint) or job.launcher.name != "local", "runtime.rdzv_endpoint",
                r.rdzv_endpoint, "must be host:port of node 0 when runtime.nnodes > 1")
        gpus = runtime.local_gpu_count() if job.launcher.name == "local" else 0
        require(gpus == 0 or nproc_per_node(job) <= gpus, "runtime.nproc_per_node", nproc_per_node(job),
                f"must be <= {gpus}, the GPUs on this machine (each rank takes one)")


def _parallel(job, dims: Degrees) -> None:
    m, s = job.model, job.strategy
    if dims.tp > 1:
        for key in ("n_heads", "n_kv_heads", "dim", "ffn_dim"):
            require(getattr(m, key) % dims.tp == 0, f"model.{key}", getattr(m, key),
                    f"must be divisible by the tensor-parallel degree strategy.tp={dims.tp}")
    if job.kernels.name == "triton":
        here = job.launcher.name == "local"
        require(not here or runtime.local_gpu_count() > 0 or os.environ.get("TRITON_INTERPRET") == "1",
                "kernels", "triton",
                "needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on the CPU (slowly, for testing)")
        require(dims.tp == 1, "kernels", "triton", f"works with strategy=ddp or fsdp2 (strategy.tp=1); "
                f"strategy={s.name} hands the kernels DTensors")


def _recipe(job) -> None:
    """The recipe, the data and the model fit together."""
    recipe, data = job.recipe.name, job.data.name
    if recipe in DATA and data != DATA[recipe]:
        raise ConfigError(
            "data",
            data,
            f"recipe={recipe} trains on data={DATA[recipe]} "
            f"({'rows with messages' if recipe == 'sft' else 'rows with prompt, chosen, rejected'})",
        )
    if data in DATA.values():
        wanted = next(r for r, d in DATA.items() if d == data)
        require(recipe == wanted, "recipe", recipe, f"data={data} is for recipe={wanted}")
        require(job.model.name == "hf", "model", job.model.name, f"data={data} tokenizes with the model "
                "directory's tokenizer and chat template: use model=hf model.path=<directory>")
        require(bool(job.data.path), "data.path", job.data.path,
                f"data={data} needs a JSONL file, or Parquet files, of its rows")
        c = job.data.cache
        require(not (c.endpoints or c.eval_endpoints or c.nodes), "data.cache", "set",
                f"data={data} is read from its local corpus; cache nodes serve "
                "token rows of data=stdlib or data=parquet only")
    require(not job.data.packing or data == "chat", "data.packing", True,
            f"packs conversations of data=chat; data={data} has none to pack")
    require(not (job.data.packing and job.kernels.name == "triton"), "data.packing", True,
            "restarts positions per conversation, which the Triton rotary kernel does not take: use kernels=torch")


def _peft(job) -> None:
    """LoRA adapts a pretrained model."""
    if job.peft.name != "none":
        require(job.model.name == "hf", "peft", job.peft.name,
                f"LoRA adapts a pretrained model: use model=hf model.path=<directory> "
                f"(model is {job.model.name}, whose frozen weights would be random)")


def _trackers(job) -> None:
    """Where the ranks run on this machine, a tracker's package must be installed here."""
    if job.launcher.name == "local":
        for name in job.train.trackers:
            require_tracker_package(name, list(job.train.trackers))
