"""The rank entry point: `python -m trainer.worker <run_dir>/config.yaml`.

Every rank, wherever it runs, rebuilds the same job from the same resolved config file: process group
from the environment its runtime sets (torchrun's, or the Kubeflow `PET_*` variables through torchrun;
mpirun's OMPI_COMM_WORLD_*: `trainjob.runtimes`; a one-rank group when there is none), mesh, model on the
meta device, strategy, initialisation, data, and then the loop. No Hydra here: the file is already resolved.

What only the data, the checkpoints or the cache nodes can tell (`trainer.prepare.inputs.check`: too few rows for
a global batch, token ids beyond the vocabulary, a checkpoint of another model, nodes that do not answer)
is a ConfigError before the first step: one line, exit code 2. The local driver runs the same checks
before it launches anything; where it calls `run` in its own process (the default run), it hands over
what it found (`checked`: the corpus, and the checkpoint it decided the run starts from), and the checks do
not run twice. Elsewhere rank 0 decides where the run starts (`trainer.checkpoint.resume.agreed`) and every rank
checks and loads that one.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from trainer import config, models
from trainer.checkpoint import fs as checkpoint_fs
from trainer.checkpoint import resume
from trainer.config import Config, ConfigError, hf_impl
from trainer.errors import UserCodeError
from trainer.models import lora
from trainer.models.kernels import Kernels
from trainer.parallel import ParallelDims
from trainer.parallel.assembly import assemble
from trainer.prepare import inputs
from trainer.training import loop, preemption
from trainjob import allocator, runtimes, startup
from trainjob.env import DRIVER_REPORTS_ENV
from trainjob.files import write_whole
from trainjob.run_files import RunDir

log = logging.getLogger("trainer")
IMPORTED_AT = time.time()  # a rank started as `python -m trainer.worker`: its imports are done


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(runtime: str | None = None) -> DistEnv:
    """Join the process group that the ranks' `runtime` describes in their environment (its variables read as
    torch.distributed's: `trainjob.runtimes`), or form a one-rank group in this process."""
    if runtime is not None:
        os.environ.update(runtimes.get(runtime).rank_env(os.environ))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        local_rank, device, backend = int(os.environ.get("LOCAL_RANK", 0)), torch.device("cpu"), "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device)


def setup_logging(run_dir: str, rank: int) -> logging.Handler:
    """Every rank logs to `<run_dir>/logs/rank-<r>.log`; rank 0 also to the console."""
    os.makedirs(RunDir.of(run_dir).logs, exist_ok=True)
    handler = logging.FileHandler(RunDir.of(run_dir).rank_log(rank))
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in root.handlers) and rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(handler.formatter)
        root.addHandler(console)
    if rank != 0:
        for h in root.handlers:
            if not isinstance(h, logging.FileHandler):
                h.setLevel(logging.WARNING)
    return handler


def run(cfg: DictConfig | Config, checked: inputs.Checked | None = None) -> dict:
    """Train the job `cfg` (a resolved config, as saved; or the driver's typed config, in its process) describes,
    as this rank; return the summary (the same on every rank). `checked`: the inputs were checked in this
    process already (by the driver)."""
    cfg = cfg if isinstance(cfg, Config) else config.typed(cfg)
    env = init_distributed(cfg.runtime.name if cfg.runtime is not None else None)
    handler = setup_logging(cfg.run_dir, env.rank)
    set_allocator(allocator.policy_for(cfg.train.allocator, cfg.data.seq_len, env.device.type))
    if (started := startup.marks(IMPORTED_AT, time.time())) is not None:
        log.info("startup %s", json.dumps(started))
    try:
        summary = _train(cfg, env, checked)
    except BaseException:
        if env.world_size == 1:  # no peer to wait for; the driver process may start another run
            dist.destroy_process_group()
        raise
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    # Only after success: destroying the group while a peer is still inside a collective would hang.
    # The barrier drains every outstanding collective first; gloo threads still holding work when the
    # interpreter shuts down abort the process.
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _train(cfg: Config, env: DistEnv, checked: inputs.Checked | None = None) -> dict:
    torch.manual_seed(cfg.train.seed)
    checkpoint_fs.configure(cfg.train.checkpoint_retries)  # before the first request to an object store
    dims = ParallelDims.from_config(cfg.strategy, env.world_size)
    # Where it starts: rank 0 decides and every rank checks that start (the driver decided it, in its process).
    checked = checked or inputs.check(cfg, dims, resume.agreed)
    mesh = dims.build_mesh(env.device.type)
    if cfg.model.name == "hf":  # which code runs the directory, and why
        log.info("%s", hf_impl.describe(cfg.model.path, cfg.model.impl))
    kernels = Kernels.of(cfg.kernels, cfg.optim)  # the kernel switch, decided once
    ppo = cfg.recipe.name == "ppo"
    model = assemble(cfg.model, cfg, dims, kernels, score_head=cfg.recipe.name == "reward",
                     value_head=ppo and cfg.recipe.value_model == "shared")
    if ppo and cfg.recipe.value_model == "separate":  # trained in the run's optimizer, kept in its checkpoints
        from trainer.recipes import ppo as ppo_recipe

        ppo_recipe.attach_value_model(model, cfg, dims, kernels)
    log.info("model %s: %.2fM parameters, world size %d, strategy %s on mesh %s, device %s, %d threads on CPUs %s",
             cfg.model.name, models.num_params(model) / 1e6, env.world_size, cfg.strategy.name,
             dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)), env.device, torch.get_num_threads(),
             ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    if cfg.peft.name != "none":  # as PEFT's print_trainable_parameters says it
        log.info("%s", lora.trainable_parameters(model))
    trainer = loop.Trainer(cfg, model, dims, env.device, checked.corpus, kernels)
    resume.settle(checked.start, cfg)
    if checked.start is not None:
        trainer.restore(checked.start.path)
    return trainer.fit()


def set_allocator(policy: str) -> None:
    """Set glibc's malloc policy `policy` (train.allocator, resolved) for this process, and log what holds."""
    earlier = allocator.chosen()
    if policy == "release" and allocator.release_freed_buffers():
        log.info("allocator: release (glibc maps blocks of 1 MiB or more on their own: freed ones go back at once)")
    elif policy == "release":
        log.info("allocator: release not set: malloc settings in the environment (MALLOC_*, GLIBC_TUNABLES, "
                 "LD_PRELOAD), another C library or this process's earlier policy (%s) decide", earlier)
    elif earlier is not None:  # a run before this one in the same process (a multirun) set it; it lasts
        log.info("allocator: %s stays from an earlier run in this process (train.allocator wants %s)", earlier,
                 policy)


def die_with_agent() -> None:
    """Under torchrun, have the kernel kill this rank when its agent dies: a node whose agent is lost must
    lose its ranks too, or they would train on with the others while the agent's peers re-form without it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    agent = os.getppid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != agent:  # it died before the request took
        os._exit(1)


def report_error(report: str, config_path: str) -> None:
    """Leave `report` (a refusal this rank found, or the report of user code that failed) in
    `<run_dir>/logs/rank-<R>.error`; print it too, unless the driver waiting on this machine prints it (once,
    whichever ranks failed)."""
    rank = int(os.environ.get("RANK", "0"))
    with contextlib.suppress(Exception):  # a run directory gone or full: the report is still printed below
        write_whole(RunDir.of(OmegaConf.load(config_path).run_dir).error_report(rank), report + "\n")
        if os.environ.get(DRIVER_REPORTS_ENV):
            return
    print(report, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainer.worker <run_dir>/config.yaml", file=sys.stderr)
        return 2
    # A rank that crashes in native code (SIGSEGV, SIGABRT) prints every thread's Python stack first.
    faulthandler.enable(all_threads=True)
    die_with_agent()
    code = 0
    try:
        run(OmegaConf.load(argv[0]))
    except ConfigError as e:  # what only a rank can see (the model transformers builds, its devices)
        report_error(f"error: {e}", argv[0])
        code = 2
    except preemption.Preempted as e:
        print(str(e), file=sys.stderr)
        code = preemption.EXIT_CODE
    except UserCodeError as e:
        report_error(e.report(), argv[0])
        code = 1
    except OSError as e:  # a full disk, or an object store that failed a checkpoint (trainer.checkpoint.writing)
        if e.errno == errno.EREMOTEIO:  # every rank fails that save alike: the driver says it once
            report_error(f"error: {e.strerror}", argv[0])
        elif e.errno == errno.ENOSPC:
            print(f"error: {e.strerror}", file=sys.stderr)
        else:
            traceback.print_exc()
        code = 1
    except Exception:  # a peer lost mid-collective, or a bug: the traceback, as the interpreter would print it
        traceback.print_exc()
        code = 1
    # Done: leave without the interpreter's teardown, where a collective backend's threads, destroyed
    # late, have been seen to abort (SIGABRT) a rank that had succeeded, and where a rank whose peer died
    # spent a second in the process group's native teardown before its agent could re-form the job.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
