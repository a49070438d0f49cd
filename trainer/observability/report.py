"""`python -m trainer.observability.report PATH...`: one table of the runs under run or sweep directories (the
config keys whose values differ between them, final train and eval loss, tokens/s, peak memory, time) and
`report.png` with every run's loss curve.

A `-m` sweep writes the same into its sweep directory when it ends: `SweepReport`, a Hydra callback that
`conf/config.yaml` registers under `hydra.callbacks`.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from trainjob.cli import OneLineParser
from trainjob.files import directory_problem
from trainjob.run_files import RunDir, read_events, read_summary

log = logging.getLogger(__name__)
# Keys that differ between any two runs without being a choice: where each run went.
NOT_CHOICES = ("run_dir",)


class ReportError(ValueError):
    """A path that is not a run or sweep directory."""


@dataclass
class RunRow:
    run: str  # the run directory, relative to the runs' common folder
    overrides: dict[str, str]  # the config keys whose values differ between the runs reported
    steps: int | None
    final_train_loss: float | None
    final_eval_loss: float | None
    tokens_per_s: float | None
    peak_memory_gb: float | None
    time_s: float | None
    events: str = "-"  # the run's events by kind (events.jsonl): "2 reformation, 1 preemption"


def is_run(path: str) -> bool:
    return RunDir.of(path).is_run()


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def find_runs(path: str) -> list[str]:
    """`path` itself when it is a run directory, else the run directories under it (a sweep's, or a
    folder of runs), in natural order (sweep job 2 before job 10)."""
    if not os.path.isdir(path):
        raise ReportError(f"{path}: no such directory")
    if is_run(path):
        return [os.path.abspath(path)]
    runs = []
    for root, dirs, _ in os.walk(path):
        dirs.sort(key=_natural)
        if is_run(root):
            runs.append(os.path.abspath(root))
            dirs.clear()  # a run's own folders (checkpoints, tb, mlruns) hold no runs
        else:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
    if not runs:
        raise ReportError(
            f"{path}: not a run directory (no config.yaml beside metrics.jsonl or summary.json) "
            "and no run directory under it"
        )
    return runs


def flat_config(run_dir: str) -> dict[str, str]:
    """The run's config.yaml as dotted keys and text values (interpolations left as written); ReportError
    naming the file when it is not a config (empty, not YAML, not a mapping)."""
    from trainer.observability.trackers import flat_params

    path = RunDir.of(run_dir).config
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # YAML and OmegaConf raise many kinds: one line naming the file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ReportError(f"{path}: not a run's config ({reason})") from None
    if not isinstance(cfg, DictConfig) or not cfg or "run_dir" not in cfg:
        what = "empty" if not cfg else "not a mapping of keys" if not isinstance(cfg, DictConfig) else "no run_dir"
        raise ReportError(f"{path}: not a run's config ({what})")
    return flat_params(cfg)


def differing(configs: list[dict[str, str]]) -> list[str]:
    """The keys whose values are not the same in every config (a key some configs lack counts as differing),
    in the order they first appear."""
    keys = list(dict.fromkeys(k for c in configs for k in c))
    return [k for k in keys if k not in NOT_CHOICES and len({c.get(k) for c in configs}) > 1]


def _summary(run_dir: str) -> dict[str, Any]:
    """The run's summary.json; {} when there is none, and, with a warning naming it, when it is not whole
    (the row then comes from the metrics lines, as for a run still going)."""
    summary, path = read_summary(run_dir), RunDir.of(run_dir).summary
    if summary is None and os.path.isfile(path):
        print(f"warning: {path} is not a run's summary (cut short, or not a JSON object); its row comes from "
              "metrics.jsonl", file=sys.stderr)
    return summary or {}


def pruned_at(run_dir: str) -> int | None:
    """The step at which a sweep's pruner stopped the run (its `pruned` event), or None."""
    steps = [e.get("at_step") for e in read_events(run_dir) if e["event"] == "pruned"]
    return steps[-1] if steps else None


def events_text(run_dir: str) -> str:
    """The run's events counted by kind, in order of first occurrence: '2 reformation, 1 preemption'; a
    sweep's pruned trial says the step it was stopped at: 'pruned at step 50'."""
    counts: dict[str, int] = {}
    for event in read_events(run_dir):
        counts[str(event["event"])] = counts.get(str(event["event"]), 0) + 1
    return ", ".join(f"pruned at step {pruned_at(run_dir)}" if kind == "pruned" else f"{n} {kind}"
                     for kind, n in counts.items()) or "-"


def row(run_dir: str, label: str, overrides: dict[str, str], records: list[dict]) -> RunRow:
    """A finished run's numbers from its summary.json; one without (running, failed) from its last lines."""
    s = _summary(run_dir)
    if s:
        peaks = [p for p in s.get("peak_memory_gb_per_rank") or [] if p is not None]
        return RunRow(
            label,
            overrides,
            s.get("steps"),
            s.get("final_train_loss"),
            s.get("final_eval_loss"),
            s.get("tokens_per_s"),
            max(peaks) if peaks else None,
            s.get("train_time_s"),
            events_text(run_dir),
        )
    last = records[-1] if records else {}
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    peaks = [r["peak_memory_gb"] for r in records if "peak_memory_gb" in r]
    return RunRow(
        label,
        overrides,
        last.get("step"),
        last.get("loss"),
        evals[-1] if evals else None,
        last.get("tokens_per_s"),
        max(peaks) if peaks else None,
        last.get("elapsed_s"),
        events_text(run_dir),
    )


def collect(paths: list[str]) -> tuple[list[RunRow], list[tuple[str, list[dict]]]]:
    """The table's rows and the curves for every run under `paths` (each run once)."""
    from trainjob.run_files import read_metrics

    runs = list(dict.fromkeys(r for p in paths for r in find_runs(p)))
    configs = [flat_config(r) for r in runs]
    keys = differing(configs)
    common = os.path.commonpath(runs)
    rows, curves = [], []
    for run_dir, cfg in zip(runs, configs, strict=True):
        label = os.path.relpath(run_dir, common) if len(runs) > 1 else os.path.basename(run_dir)
        records = read_metrics(run_dir)
        overrides = {k: cfg.get(k, "-") for k in keys}
        rows.append(row(run_dir, label, overrides, records))
        # A run is named in the legend by the values that tell it apart, or by its directory where none differ.
        pruned = pruned_at(run_dir)
        name = " ".join(f"{k}={_short(v)}" for k, v in overrides.items()) or label
        curves.append((" ".join([name, *([f"(pruned at step {pruned})"] if pruned is not None else [])]), records))
    return rows, curves


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _short(value: str) -> str:
    """A config value as the table shows it: a float to 4 significant digits (an Optuna trial's 0.0016051911...)."""
    try:
        return format(float(value), ".4g") if any(c in value for c in ".eE") else value
    except ValueError:
        return value


def table(rows: list[RunRow]):
    """The rows as a rich Table."""
    from rich.table import Table

    t = Table(title=f"{len(rows)} run{'s' if len(rows) != 1 else ''}")
    t.add_column("run")
    keys = list(rows[0].overrides) if rows else []
    for key in keys:
        t.add_column(key)
    for name in ("steps", "train loss", "eval loss", "tokens/s", "peak mem GiB", "time s"):
        t.add_column(name, justify="right")
    events = any(r.events != "-" for r in rows)  # a column only when a run was resumed, re-formed or preempted
    if events:
        t.add_column("events")
    for r in rows:
        numbers = [
            _number(r.steps, "d"),
            _number(r.final_train_loss, ".4f"),
            _number(r.final_eval_loss, ".4f"),
            _number(r.tokens_per_s, ".0f"),
            _number(r.peak_memory_gb, ".3f"),
            _number(r.time_s, ".1f"),
            *([r.events] if events else []),
        ]
        t.add_row(r.run, *(_short(r.overrides[k]) for k in keys), *numbers)
    return t


def default_output(paths: list[str]) -> str:
    """report.png in the paths' common folder."""
    return os.path.join(os.path.commonpath([os.path.abspath(p) for p in paths]), "report.png")


def report(paths: list[str], output: str | None = None, console=None) -> tuple[list[RunRow], str]:
    """Print the table of the runs under `paths` and write their curves to `output` (default: report.png in
    the paths' common folder); return the rows and the picture's path."""
    from rich.console import Console

    from trainer.observability import plots

    rows, curves = collect(paths)
    output = output or default_output(paths)
    # Not on a terminal (a log, a pipe): wide enough that a sweep's columns are not cut to a few letters.
    (console or Console(width=None if sys.stdout.isatty() else 200)).print(table(rows))
    plots.save(plots.report_figure(curves), output)
    return rows, output


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.observability.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="run or sweep directories")
    parser.add_argument(
        "-o", "--output", help="where to write the picture (default: report.png in the paths' common folder)"
    )
    args = parser.parse_args(argv)
    if args.output and not args.output.endswith(".png"):
        parser.error(f"--output {args.output}: the picture is a PNG; give a path ending in .png")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        parser.error(f"--output {args.output}: no such directory {os.path.dirname(os.path.abspath(args.output))}")
    try:
        for path in args.paths:
            find_runs(path)
        output = args.output or default_output(args.paths)
        problem = "is a directory" if os.path.isdir(output) else directory_problem(os.path.dirname(output))
        if problem:
            raise ReportError(f"{'--output ' if args.output else ''}{output}: {problem}; the picture is written "
                              "there" + ("" if args.output else " (give -o elsewhere.png)"))
        _, output = report(args.paths, output)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk filled, or the folder went away, while writing
        print(f"error: could not write {e.filename or output}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"report: {output}")
    return 0


class SweepReport(Callback):
    """At the end of a `-m` sweep (basic or Optuna), the report of its runs in the sweep directory."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        try:
            _, output = report([sweep_dir])
        except ReportError as e:  # e.g. every run refused: the sweep's own errors said why
            log.warning("no sweep report: %s", e)
            return
        log.info("sweep report: %s", output)


if __name__ == "__main__":
    sys.exit(main())
