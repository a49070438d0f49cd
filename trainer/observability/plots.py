"""Loss-curve pictures drawn with matplotlib's Agg backend (no display, no pyplot state): `loss.png` of one
run from its own metrics.jsonl, and the sweep report's picture of many runs."""

from __future__ import annotations

import logging
import math
import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator
from omegaconf import OmegaConf

from trainjob.run_files import RunDir, read_metrics

log = logging.getLogger(__name__)
# The loss axis is log-scaled once the losses span more than this factor (a fall from ln(259) ~ 5.6 to
# under 2.8): the early drop would otherwise flatten the rest of the curve.
LOG_SCALE_SPAN = 2.0


def tokens_per_step(run_dir: str) -> int | None:
    """Tokens one step trains on (global batch x sequence length), from the run's config.yaml."""
    path = RunDir.of(run_dir).config
    if not os.path.exists(path):
        return None
    try:
        cfg = OmegaConf.load(path)
        return int(cfg.train.global_batch_size) * int(cfg.data.seq_len)
    except Exception:  # a damaged config.yaml (YAML or OmegaConf errors): the picture has no tokens axis
        return None


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _label_axes(ax, values: list[float]) -> None:
    """Steps on x (whole numbers), the loss on y, log-scaled when `values` span more than LOG_SCALE_SPAN."""
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if positive and max(positive) / min(positive) > LOG_SCALE_SPAN:
        ax.set_yscale("log")
    ax.set_ylabel("loss (nats/token)" + (", log scale" if ax.get_yscale() == "log" else ""))


def loss_figure(records: list[dict], tokens_per_step: int | None = None, title: str | None = None) -> Figure:
    """Train and eval loss against step, with tokens seen on the top axis when `tokens_per_step` is known."""
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train_steps, train = _series(records, "loss")
    eval_steps, evals = _series(records, "eval_loss")
    ax.plot(train_steps, train, label="train loss", color="tab:blue", linewidth=1.5)
    ax.plot(eval_steps, evals, label="eval loss", color="tab:orange", marker="o", linewidth=1.5)
    _label_axes(ax, train + evals)
    if tokens_per_step:
        top = ax.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step, lambda t: t / tokens_per_step))
        top.set_xlabel("tokens")
        top.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, 1.2M
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def report_figure(curves: list[tuple[str, list[dict]]]) -> Figure:
    """Every run's train loss (solid) and eval loss (dashed, dots) against step, one colour per run."""
    fig = Figure(figsize=(9, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(curves))]
    values: list[float] = []
    for (label, records), color in zip(curves, colors, strict=True):
        train_steps, train = _series(records, "loss")
        eval_steps, evals = _series(records, "eval_loss")
        ax.plot(train_steps, train, color=color, label=label, linewidth=1.2)
        ax.plot(eval_steps, evals, color=color, linestyle="--", marker="o", markersize=3, label="_nolegend_")
        values += train + evals
    _label_axes(ax, values)
    ax.set_title("train loss (solid) and eval loss (dashed)")
    ax.grid(True, which="both", alpha=0.3)
    if curves:
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def save(fig: Figure, path: str) -> str:
    """Write `fig` as a PNG at `path`, whole or not at all (no temporary file left either way)."""
    tmp = path + ".tmp"
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise
    return path


def save_loss_png(run_dir: str) -> str | None:
    """`<run_dir>/loss.png` from the run's metrics.jsonl; a picture that cannot be drawn is a warning, not a
    failed run."""
    try:
        title = "/".join(os.path.normpath(run_dir).split(os.sep)[-2:])
        fig = loss_figure(read_metrics(run_dir), tokens_per_step(run_dir), title=title)
        return save(fig, RunDir.of(run_dir).loss_png)
    except (OSError, ValueError) as e:
        log.warning("could not draw %s/loss.png: %s", run_dir, e)
        return None
