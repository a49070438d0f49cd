"""Experiment trackers: where rank 0 sends each metrics line (`tracker.report_to`).

`jsonl` (`<run_dir>/metrics.jsonl`) is always on; `tensorboard` writes event files under `<run_dir>/tb/`,
`mlflow` logs to `tracker.mlflow.tracking_uri` (default: a file store in `<run_dir>/mlruns`), `wandb` logs
offline under `<run_dir>/wandb/` unless `tracker.wandb.mode` or WANDB_MODE says otherwise. Every tracker
takes the same lines through one interface (`log`, `close`); `open_trackers` opens those the config names.

A resumed run continues the same curves: TensorBoard purges the events after the step resumed from
(`purge_step`), MLflow and W&B go on in the run whose id `<run_dir>/tracking.json` keeps. MLflow and W&B
cannot delete points, so theirs after the step resumed from stay beside the new ones.

This module imports no tracker library (and no torch) at its top: the driver checks the config without
them.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
import uuid
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from trainer.config.tracker import require_tracker_package
from trainjob.env import CACHE_TOKEN_ENV
from trainjob.files import write_whole
from trainjob.run_files import RunDir

FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"

# TensorBoard tags of the metrics lines' keys: one section per kind of number.
TB_TAGS = {
    "loss": "loss/train",
    "eval_loss": "loss/eval",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "tokens": "perf/tokens",
    "trained_tokens": "perf/trained_tokens",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
    "peak_memory_gb": "perf/peak_memory_gb",
    "elapsed_s": "perf/elapsed_s",
}


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None:
        """One metrics line: `step` and the numbers measured at it."""

    def close(self, finished: bool) -> None:
        """Flush and stop; `finished`: the run trained every step (else it failed or was stopped)."""


def run_name(cfg: DictConfig, configured: str | None) -> str:
    if configured:
        return configured
    parts = pathlib.Path(cfg.run_dir).parts
    return "/".join(parts[-2:])


def saved_config(cfg: Any) -> DictConfig:
    """The config as the run directory's config.yaml keeps it: interpolations (the cache token's
    `${oc.env:...}`) as written, so that a secret is never resolved into a tracker. Without that file (a
    Trainer built from Python), the typed config with the token masked."""
    path = RunDir.of(cfg.run_dir).config
    if os.path.exists(path):
        return OmegaConf.load(path)
    saved = OmegaConf.structured(cfg) if not isinstance(cfg, DictConfig) else cfg.copy()
    if OmegaConf.select(saved, "data.cache.token") is not None:
        saved.data.cache.token = "${oc.env:" + CACHE_TOKEN_ENV + "}"
    return saved


def flat_params(cfg: Any) -> dict[str, str]:
    """The config as dotted keys and text values (see `saved_config`)."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = json.dumps(node) if isinstance(node, (list, dict)) else str(node)

    walk(OmegaConf.to_container(saved_config(cfg), resolve=False), "")
    return out


def config_text(cfg: Any) -> str:
    """The config as YAML (see `saved_config`), indented as a Markdown code block (TensorBoard renders text
    as Markdown)."""
    yaml = OmegaConf.to_yaml(saved_config(cfg), resolve=False)
    return "\n".join("    " + line for line in yaml.splitlines())


def _read_state(run_dir: str) -> dict:
    path = RunDir.of(run_dir).tracking
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_state(run_dir: str, **entries: Any) -> None:
    state = {**_read_state(run_dir), **entries}
    write_whole(RunDir.of(run_dir).tracking, json.dumps(state, indent=2))


class JsonlTracker:
    """`<run_dir>/metrics.jsonl`, a line each, flushed as written."""

    def __init__(self, run_dir: str):
        self._file = open(RunDir.of(run_dir).metrics, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self, finished: bool) -> None:
        self._file.close()


class TensorBoardTracker:
    """Event files under `<run_dir>/tb/`; a run resumed at step S purges what an earlier attempt wrote after S."""

    def __init__(self, cfg: DictConfig, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(RunDir.of(cfg.run_dir).tensorboard, purge_step=start_step + 1)
        self._writer.add_text("config", config_text(cfg), global_step=start_step)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step":
                self._writer.add_scalar(TB_TAGS.get(key, f"other/{key}"), value, global_step=step)

    def close(self, finished: bool) -> None:
        self._writer.close()


class MlflowTracker:
    """One MLflow run per run directory: created with the config as params, continued on resume."""

    def __init__(self, cfg: DictConfig, start_step: int):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        m = cfg.tracker.mlflow
        uri = m.tracking_uri or pathlib.Path(RunDir.of(cfg.run_dir).mlruns).resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 keeps the file store (maintenance mode) behind this opt-in
            os.environ.setdefault(FILE_STORE_ENV, "true")
        self.client = MlflowClient(tracking_uri=uri)
        state = _read_state(cfg.run_dir).get("mlflow", {})
        self.run_id = state.get("run_id") if state.get("tracking_uri") == uri else None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "trainjob.resumed_at_step", str(start_step))
            return
        experiment = self.client.get_experiment_by_name(m.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(m.experiment)
        run = self.client.create_run(
            experiment_id, run_name=run_name(cfg, m.run_name), tags={"trainjob.run_dir": str(cfg.run_dir)}
        )
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in flat_params(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        _write_state(cfg.run_dir, mlflow={"tracking_uri": uri, "run_id": self.run_id})

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["step"])
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in record.items() if k != "step"]
        )

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "FAILED")


class WandbTracker:
    """A W&B run per run directory (offline unless configured), resumed by the id kept in the run directory.
    Points go against our own `step` metric, so that a resumed run's earlier steps are not dropped."""

    def __init__(self, cfg: DictConfig, start_step: int):
        import wandb

        w = cfg.tracker.wandb
        state = _read_state(cfg.run_dir).get("wandb", {})
        run_id = state.get("run_id") or uuid.uuid4().hex[:8]
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=run_name(cfg, w.run_name),
            id=run_id,
            resume="allow",
            dir=cfg.run_dir,
            mode=w.mode or os.environ.get("WANDB_MODE", "offline"),
            config=flat_params(cfg),
            settings=wandb.Settings(console="off"),  # our stdout stays ours
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if not state:
            _write_state(cfg.run_dir, wandb={"run_id": run_id})

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(dict(record))

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class Trackers:
    """The run's trackers as one: each line goes to every one of them."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def close(self, finished: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(finished)


def open_trackers(cfg: DictConfig, start_step: int) -> Trackers:
    """Open `metrics.jsonl` and the trackers `tracker.report_to` names, for a run going on from `start_step`
    (0: a fresh one). Rank 0 only. A missing package is a ConfigError (the worker's one line, exit 2)."""
    chosen = list(dict.fromkeys(cfg.tracker.report_to))
    opened: list[Tracker] = [JsonlTracker(cfg.run_dir)]
    try:
        for name in chosen:
            if name == "jsonl":
                continue
            require_tracker_package(name, chosen)
            kind = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}[name]
            opened.append(kind(cfg, start_step))
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)
