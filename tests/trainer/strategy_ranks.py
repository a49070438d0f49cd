"""A torchrun worker for tests/trainer/parallel/test_pipeline.py: every rank trains each run whose resolved config
file it is given, one after another in one process group, as `trainer.worker` trains one; so a single torchrun start
serves several strategies (most of a small run's time is the start of its processes).

    torchrun --standalone --nproc-per-node N -m tests.trainer.strategy_ranks RUN_DIR/config.yaml ...
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist
from omegaconf import OmegaConf

from trainer import config, worker


def main(paths: list[str]) -> None:
    env = worker.init_distributed()
    for path in paths:
        cfg = config.typed(OmegaConf.load(path))
        handler = worker.setup_logging(cfg.run_dir, env.rank)
        try:
            worker._train(cfg, env)
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as trainer.worker leaves: no teardown of the collective backend's threads
