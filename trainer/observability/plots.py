"""Loss-curve pictures drawn with matplotlib's Agg backend (no display, no pyplot state): `loss.png` of one
run from its own metrics.jsonl, and the sweep report's picture of many runs."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator
from omegaconf import OmegaConf

from trainjob.run_files import RunDir, read_metrics

log = logging.getLogger(__name__)
# The loss axis is log-scaled once the losses span more than this factor (a fall from ln(259) ~ 5.6 to
# under 2.8): the early drop would otherwise flatten the rest of the curve.
LOG_SCALE_SPAN = 2.0


# What each recipe's loss is, and the quantity of its own drawn under it (metric, label): DPO's and the reward
# model's reward margin, GRPO's and RLOO's mean reward. Any other recipe: the next-token loss alone.
RECIPE_AXES = {
    "dpo": ("DPO loss (nats/pair)", ("rewards/margins", "reward margin (nats, chosen - rejected)")),
    "kto": ("KTO loss (per completion)", ("rewards/margins", "reward margin (nats, desirable - undesirable)")),
    "reward": ("pairwise loss (nats/pair)", ("margin", "score margin (chosen - rejected)")),
    "grpo": ("GRPO loss (clipped surrogate)", ("reward", "mean reward per completion")),
    "rloo": ("RLOO loss (clipped surrogate)", ("reward", "mean reward per completion")),
}
TOKEN_LOSS = ("loss (nats/token)", None)
# A series with at most this many points is drawn with a marker on each (a single point shows); beyond it, a line.
MARKED_POINTS = 60


def _run_config(run_dir: str):
    path = RunDir.of(run_dir).config
    if not os.path.exists(path):
        return None
    try:
        return OmegaConf.load(path)
    except Exception:  # a damaged config.yaml (YAML or OmegaConf errors): the picture goes without it
        return None


def tokens_per_step(run_dir: str) -> int | None:
    """Positions one step takes (global batch x sequence length), from the run's config.yaml: the tokens axis of
    a run whose metrics predate their real-token counts."""
    cfg = _run_config(run_dir)
    try:
        return None if cfg is None else int(cfg.train.global_batch_size) * int(cfg.data.seq_len)
    except Exception:  # keys missing or not numbers: no tokens axis
        return None


def recipe_of(run_dir: str) -> str | None:
    """The run's recipe, from its config.yaml."""
    cfg = _run_config(run_dir)
    return None if cfg is None else OmegaConf.select(cfg, "recipe.name", default=None)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _plot(ax, steps: list[int], values: list[float], **style) -> None:
    """A series: its points marked where they are few (one point is a dot, not an invisible line)."""
    marked = len(steps) <= MARKED_POINTS
    ax.plot(steps, values, marker="o" if marked else None, markersize=3, linewidth=1.5 if marked else 1.0, **style)


def _step_axis(ax, steps: list[int]) -> None:
    """Whole steps on x at any length: integer ticks, a range of at least one step either side of a lone
    point, and 10k, 100k past 10000 steps."""
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if steps and max(steps) - min(steps) < 2:
        ax.set_xlim(max(0, min(steps) - 1), max(steps) + 1)
    if steps and max(steps) >= 10_000:
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))


def _label_axes(ax, values: list[float], label: str = TOKEN_LOSS[0]) -> None:
    """The loss on y, log-scaled when `values` are all positive and span more than LOG_SCALE_SPAN."""
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > LOG_SCALE_SPAN:
        ax.set_yscale("log")
    ax.set_ylabel(label + (", log scale" if ax.get_yscale() == "log" else ""))


def _tokens_seen(records: list[dict], tokens_per_step: int | None):
    """(step -> real input tokens trained on by then, and back) from the lines' `tokens` (those since the line
    before; padding never counts), straight on past the last line; a constant `tokens_per_step` for lines
    without them; None when neither is known."""
    lines = [r for r in records if "loss" in r]
    if not lines or any("tokens" not in r for r in lines):
        return (lambda s: s * tokens_per_step, lambda t: t / tokens_per_step) if tokens_per_step else None
    steps, seen = [0.0], [0.0]
    for r in lines:
        if r["step"] > steps[-1] and r["tokens"] > 0:
            steps.append(float(r["step"]))
            seen.append(seen[-1] + r["tokens"])
    if len(steps) < 2:
        return None
    rate = seen[-1] / steps[-1]
    far = max(steps[-1], 1.0) * 1e6  # past the last line at the run's mean rate, for the axis' margins
    steps, seen = np.array([*steps, far]), np.array([*seen, seen[-1] + (far - steps[-1]) * rate])
    return lambda s: np.interp(s, steps, seen), lambda t: np.interp(t, seen, steps)


def loss_figure(records: list[dict], tokens_per_step: int | None = None, title: str | None = None,
                recipe: str | None = None) -> Figure:
    """Train and eval loss against step, with the real tokens trained on by then on the top axis (`_tokens_seen`);
    under it, the recipe's own quantity where it has one (RECIPE_AXES)."""
    loss_label, extra = RECIPE_AXES.get(recipe or "", TOKEN_LOSS)
    extra_steps, extra_values = _series(records, extra[0]) if extra else ([], [])
    fig = Figure(figsize=(8, 7 if extra_values else 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if extra_values else fig.add_subplot()
    train_steps, train = _series(records, "loss")
    eval_steps, evals = _series(records, "eval_loss")
    _plot(ax, train_steps, train, label="train loss", color="tab:blue")
    _plot(ax, eval_steps, evals, label="eval loss", color="tab:orange")
    _step_axis(ax, train_steps + eval_steps)
    _label_axes(ax, train + evals, loss_label)
    tokens = _tokens_seen(records, tokens_per_step)
    if tokens:
        top = ax.secondary_xaxis("top", functions=tokens)
        top.set_xlabel("tokens")
        top.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, 1.2M
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if extra_values:
        below = fig.add_subplot(2, 1, 2, sharex=ax)
        _plot(below, extra_steps, extra_values, color="tab:green", label=extra[0])
        _step_axis(below, train_steps + eval_steps + extra_steps)
        below.set_ylabel(extra[1])
        below.grid(True, alpha=0.3)
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
    steps: list[int] = []
    for (label, records), color in zip(curves, colors, strict=True):
        train_steps, train = _series(records, "loss")
        eval_steps, evals = _series(records, "eval_loss")
        _plot(ax, train_steps, train, color=color, label=label)
        _plot(ax, eval_steps, evals, color=color, linestyle="--", label="_nolegend_")
        values += train + evals
        steps += train_steps + eval_steps
    _step_axis(ax, steps)
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
        fig = loss_figure(read_metrics(run_dir), tokens_per_step(run_dir), title=title, recipe=recipe_of(run_dir))
        return save(fig, RunDir.of(run_dir).loss_png)
    except (OSError, ValueError) as e:
        log.warning("could not draw %s/loss.png: %s", run_dir, e)
        return None
