"""The driver, `python -m trainer [overrides]`: compose the config with Hydra, validate it, save the
resolved `<run_dir>/config.yaml`, hand it to the launcher, and return the final eval loss (so that Hydra
sweepers can optimise it).

A config that cannot run (Hydra's composition errors, every rule in `trainer.config.validate`, and, for the
local launcher, what the data, the checkpoint or the cache nodes say: `trainer.prepare.inputs.check`) ends
the process with exit code 2 and one line before anything is launched, and leaves no run directory behind.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import launchers
from trainer import config
from trainer.config import readers
from trainer.config.compose import CONF_DIR, plain_group_overrides, register
from trainer.errors import UserCodeError
from trainer.prepare.preflight import check
from trainer.prepare.run_dir import Claim, claim, let_go, node_running, remove_if_new
from trainer.sweep.sweeper import register as register_sweeper
from trainer.training.preemption import EXIT_CODE, Preempted
from trainjob import process_tree
from trainjob.env import (
    CACHE_ENDPOINTS_ENV,
    CACHE_EVAL_ENDPOINTS_ENV,
    CACHE_TOKEN_ENV,
    DRIVER_REPORTS_ENV,
    RDZV_TIMEOUT_EXIT,
)
from trainjob.files import write_whole
from trainjob.nodes import node_range
from trainjob.run_files import RunDir

log = logging.getLogger("trainer")
_job_started = False

register()
register_sweeper()  # hydra/sweeper=optuna


# The module every rank runs (`python -m trainer.worker <config.yaml>`), named to the runtime that starts it.
WORKER = "trainer.worker"

# Keys of the runtime section that differ by node by design (each node's own): not in config.yaml, so not in
# the comparison of the nodes' configs.
PER_NODE_KEYS = ("node_rank",)


def _save_config(resolved: dict, run_dir: str, running: bool = False) -> str:
    """Write `<run_dir>/config.yaml`; an earlier, different one is kept as config.<n>.yaml. `running`: another
    node of this run trains from the file already, so a different config is refused."""
    path = RunDir.of(run_dir).config
    text = OmegaConf.to_yaml(OmegaConf.create(resolved))
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return path
        if running:
            raise config.ConfigError("hydra.run.dir", run_dir, f"another node of this run trains from {path}, "
                                     "a different config: start every node with the same command")
        n = 1
        while os.path.exists(RunDir.of(run_dir).earlier_config(n)):
            n += 1
        os.rename(path, RunDir.of(run_dir).earlier_config(n))
    write_whole(path, text)
    return path


@dataclass(frozen=True)
class Prepared:
    """A checked run: what to start (`spec`), the launcher and scheduler options that say where, and the
    driver's typed config (`job`), which a run in this process trains from rather than typing its config
    again."""

    spec: launchers.LaunchSpec
    launcher: dict
    scheduler: dict
    checked: Any = None  # what the input checks found here (`trainer.prepare.inputs.Checked`); None: not run here
    job: config.Config | None = None
    offers: Any = None  # what the launcher offers (`trainjob.runtimes.Offers`)


    def launcher_for(self) -> launchers.Launcher:
        """The launcher to start it: this process for the local launcher without a runtime (the worker
        called here, its summary kept, its inputs checked once: here, before), else the configured one."""
        if self.offers.in_process and self.spec.runtime is None:
            from trainer import worker

            # Cache nodes started beside it name their endpoints only once up: the saved config reads them then.
            job = self.job if self.spec.cache_nodes is None else OmegaConf.create(self.spec.config)
            return launchers.InProcessLauncher(lambda: worker.run(job, self.checked))
        return launchers.get(self.launcher, self.scheduler)


def _refuse(e: Exception, run_dir: str, claimed: Claim | None = None) -> NoReturn:
    """End a run that cannot start: one line, exit 2, and nothing of it left (its directory, if new)."""
    print(f"error: {e}", file=sys.stderr)
    if claimed is not None:
        claimed.release()
    else:
        remove_if_new(run_dir)
    raise SystemExit(2) from None


def prepare_run(cfg: DictConfig, given: Mapping[str, object] | None = None) -> Prepared:
    """Check `cfg`, claim its run directory and save it there (not for a dry run, which only prints what it
    would launch), and describe the run (`given`: the keys the user set, `readers.given_keys`). The claim comes
    after the checks and before anything is written: a refused run leaves nothing, and a second driver into a
    running run's directory changes nothing."""
    run_dir = os.path.abspath(cfg.run_dir)
    try:
        job, shape, checked = check(cfg, given)
    except config.ConfigError as e:
        _refuse(e, run_dir)
    except UserCodeError as e:  # a chat template that raised while the corpus was built: exit 1, nothing left
        print(e.report(), file=sys.stderr)
        remove_if_new(run_dir)
        raise SystemExit(1) from None
    resolved = OmegaConf.to_container(cfg, resolve=True)
    saved, secrets, cache_nodes = _as_launched(resolved)
    lock_fds, node = (), None
    if resolved["launcher"].get("dry_run"):
        remove_if_new(run_dir)
        path = RunDir.of(run_dir).config
    else:
        claimed = None
        try:
            claimed = claim(run_dir, nodes=_nodes_started_here(resolved, shape), node=_node_rank(resolved))
            path = _save_config(saved, run_dir, running=claimed.others)
        except config.ConfigError as e:
            _refuse(e, run_dir, claimed)
        except OSError as e:
            _refuse(f"hydra.run.dir={run_dir}: {e.strerror or e} ({e.filename or run_dir})", run_dir, claimed)
        lock_fds, node = claimed.fds, claimed.node
    runtime = resolved.get("runtime")
    counts = shape.counts
    spec = launchers.LaunchSpec(
        run_dir=run_dir, command=["-m", WORKER, path], worker=WORKER, nnodes=counts[-1],
        runtime=None if runtime is None else launchers.RuntimeSpec(shape.unit, runtime),
        min_nodes=counts[0] if len(counts) > 1 else None, node=node,
        nproc_per_node=shape.per_node, secrets=secrets, config=saved,
        config_path=path, path_keys={"run_dir": "run_dir", "cache_dir": "data.cache_dir"},
        cache_dir=os.path.expanduser(saved["data"]["cache_dir"]), cache_nodes=cache_nodes, hold_fds=lock_fds,
        stop_grace_s=int(saved["train"]["preemption_grace_s"]),
        env={DRIVER_REPORTS_ENV: "1"} if _driver_waits_here(resolved["launcher"], shape) else {})
    return Prepared(spec, resolved["launcher"], resolved["scheduler"], checked, job, shape.offers)


def _driver_waits_here(launcher: dict, shape: config.JobShape) -> bool:
    """Whether this driver waits for the ranks and reads their run directory (this machine's, or mounted)."""
    return shape.offers.reads_disk_here and bool(launcher.get("wait", True))


def _rank_error(run_dir: str, since: float) -> str | None:
    """The report a rank of this launch left as it failed (the lowest rank's): a refusal only a rank could see,
    or user code that raised; None where no rank left one."""
    reports = []
    for rank, path in RunDir.of(run_dir).error_reports().items():
        with contextlib.suppress(OSError):
            if os.path.getmtime(path) >= since:
                with open(path, encoding="utf-8", errors="replace") as f:
                    reports.append((rank, f.read().rstrip("\n")))
    return min(reports)[1] if reports else None


def _rendezvous_timeout(spec: launchers.LaunchSpec, code: int | None) -> str | None:
    """The line for a node of a run started once per node that gave up waiting at the rendezvous (its agent's
    `code` says so; `runtime.rdzv_timeout`): how many nodes joined, and which never did; None otherwise."""
    if spec.node is None or code != RDZV_TIMEOUT_EXIT:
        return None
    joined = [n for n in range(spec.nnodes) if n == spec.node or node_running(spec.run_dir, n)]
    missing = [n for n in range(spec.nnodes) if n not in joined]
    t = spec.runtime.options
    wanted = f"{spec.min_nodes} to {spec.nnodes}" if spec.elastic else str(spec.nnodes)
    return (f"error: runtime.rdzv_timeout={t['rdzv_timeout']}: the rendezvous at {t['rdzv_endpoint']} waited "
            f"{t['rdzv_timeout']} s for {wanted} nodes: {len(joined)} joined (node {', '.join(map(str, joined))}), "
            f"node {', '.join(map(str, missing))} never did (refused, or not started: start each node with the same "
            "command)")


def _node_rank(resolved: dict) -> int | None:
    runtime = resolved.get("runtime")
    return None if runtime is None else runtime.get("node_rank")


def _nodes_started_here(resolved: dict, shape: config.JobShape) -> int:
    """How many nodes of this run may start on this machine on their own: a local multi-node run is the
    same command once per node, each in the same run directory; every other run is one driver."""
    runtime = resolved.get("runtime")
    if runtime is None or not shape.offers.nodes_started_here:
        return 1
    return node_range(runtime["nnodes"])[1]


def _as_launched(resolved: dict) -> tuple[dict, dict[str, str], launchers.CacheNodes | None]:
    """The config as saved and sent (no secret in it), the secrets the ranks get as environment variables,
    and the cache nodes to start: the config reads the token and the nodes' endpoints from the variables
    the launcher sets (`${oc.env:...}`)."""
    saved = copy.deepcopy(resolved)
    if saved.get("runtime"):  # per-node settings: every node of a run saves and compares the same file
        for key in PER_NODE_KEYS:
            if key in saved["runtime"]:
                saved["runtime"][key] = None
    cache = saved["data"]["cache"]
    secrets = {}
    if cache.get("token"):
        secrets[CACHE_TOKEN_ENV] = str(cache["token"])
        cache["token"] = f"${{oc.env:{CACHE_TOKEN_ENV}}}"
    nodes = None
    if cache.get("nodes"):
        kubeflow = cache["kubeflow"] if cache.get("backend") == "kubeflow" else None
        nodes = launchers.CacheNodes(count=int(cache["nodes"]), command=[
            "-m", "trainer.data.cache_node", "{config}", "--shard", "{index}/{count}", "--host", "{host}",
            "--port", "{port}", "--eval-port", "{eval_port}"], kubeflow=kubeflow)
        cache["endpoints"] = f"${{oc.decode:${{oc.env:{CACHE_ENDPOINTS_ENV}}}}}"
        if kubeflow is None:  # Kubeflow's cache holds one table: the eval rows come from the local corpus
            cache["eval_endpoints"] = f"${{oc.decode:${{oc.env:{CACHE_EVAL_ENDPOINTS_ENV}}}}}"
    return saved, secrets, nodes


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _app(cfg: DictConfig) -> float:
    global _job_started
    _job_started = True
    if _FULL_ERROR_SET:  # from here on, Hydra reports what goes wrong as it always does
        os.environ.pop(FULL_ERROR_ENV, None)
    run = prepare_run(cfg, readers.given_keys(HydraConfig.get().overrides.task))
    options = run.launcher
    try:
        launcher = run.launcher_for()
        if options.get("dry_run"):  # print what it would start, start nothing
            sys.stdout.write(launcher.render(run.spec))
            sys.stdout.flush()
            return float("nan")
        started = time.time()
        job = launcher.launch(run.spec)
        if not options.get("wait", True):
            print(f"submitted {job.name} ({options['name']}); run directory: {run.spec.run_dir}", flush=True)
            return float("nan")
        state = job.wait()
    except config.ConfigError as e:  # in process, what the worker found that the checks could not see
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except launchers.LauncherError as e:  # the cluster, Docker or a cache node said no: one line
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except Preempted as e:  # in process: SIGTERM, and the checkpoint to resume from is written
        print(f"{e}; the same command resumes from it", file=sys.stderr)
        raise SystemExit(EXIT_CODE) from None
    except UserCodeError as e:  # in process: the user's function raised; its checkpoints stay
        print(e.report(), file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as e:  # in process, the disk filled or the checkpoints' store failed: what was whole stays
        if e.errno not in (errno.ENOSPC, errno.EREMOTEIO):
            raise
        print(f"error: {e.strerror}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:  # this process's hold on the run directory (a job that runs on holds its own copy)
        let_go(run.spec.run_dir)
    code = getattr(job, "exit_code", None)
    # A rank refused the config or its user code raised (that report once, for every rank that failed alike), or
    # the other nodes never came.
    report = (_rank_error(run.spec.run_dir, started) or _rendezvous_timeout(run.spec, code)
              if state != launchers.JobState.COMPLETE else None)
    if report:
        print(report, file=sys.stderr)
        raise SystemExit(2 if code == 2 else 1)
    if state != launchers.JobState.COMPLETE:
        how = f": {job.failure}" if job.failure else "" if code is None else f" with exit code {code}"
        print(f"error: run {run.spec.run_dir} ({job.name}) ended {state.value}{how}; see its logs: python -m "
              f"launchers logs {job.name}", file=sys.stderr)
        raise SystemExit(1)
    summary = job.result() or {}
    loss, train = (float("nan") if summary.get(k) is None else float(summary[k])
                   for k in ("final_eval_loss", "final_train_loss"))
    final = (f"final train loss (no eval split): {train:.4f}" if math.isnan(loss) and not math.isnan(train)
             else f"final eval loss: {loss:.4f}")
    print(f"run directory: {run.spec.run_dir}\n{final} nats/token after {summary.get('steps')} steps", flush=True)
    return loss


def hide_secrets(argv: list[str]) -> list[str]:
    """Overrides with the cache token's value moved into TRAINJOB_CACHE_TOKEN and referred to as
    `${oc.env:...}`, so that Hydra never holds it: not in its echo of a sweep's overrides, not in
    multirun.yaml, not in an error message. The value is read as Hydra reads it (quotes removed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, hidden = OverridesParser.create(), []
    for arg in argv:
        if "data.cache" in arg and "=" in arg and not arg.startswith("-"):
            try:
                override = parser.parse_override(arg)
            except HydraException:
                override = None  # Hydra will say what is wrong with it
            if override is not None and override.key_or_group == "data.cache" and isinstance(override.value(), dict) \
                    and "token" in override.value():
                print("error: give the cache token as data.cache.token=..., not inside data.cache={...} (it would "
                      "be echoed and saved)", file=sys.stderr)
                raise SystemExit(2)
            if override is not None and override.key_or_group == "data.cache.token" and not override.is_delete():
                value = override.value()
                if isinstance(value, str) and value and not value.startswith("${"):
                    os.environ[CACHE_TOKEN_ENV] = value
                    arg = f"{override.get_key_element()}=${{oc.env:{CACHE_TOKEN_ENV}}}"
        hidden.append(arg)
    return hidden


def composition_error(e: Exception) -> str:
    """Hydra's report of an override it could not apply (several lines: the override, OmegaConf's reason,
    its full_key and types) as one line naming the override and the reason."""
    text = str(e) if e.__cause__ is None or str(e.__cause__) in str(e) else f"{e}\n{e.__cause__}"
    text = text.split("Config search path:")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()
             and not line.strip().startswith(("full_key:", "reference_type", "object_type"))]
    return " ".join(line if line.endswith((":", ".")) else line + ";" for line in lines).rstrip(";")


FULL_ERROR_ENV = "HYDRA_FULL_ERROR"
_FULL_ERROR_SET = False


def main() -> None:
    """The driver; every process it started has ended when it returns or exits, whatever the exit (a SIGTERM:
    143, Ctrl-C: 130), as `trainjob.process_tree` sees to."""
    process_tree.adopt_orphans()
    process_tree.raise_on_sigterm()
    try:
        _drive()
    except process_tree.Terminated:
        print(f"error: stopped by SIGTERM (exit {EXIT_CODE}); the same command resumes from the newest checkpoint",
              file=sys.stderr)
        raise SystemExit(EXIT_CODE) from None
    except KeyboardInterrupt:
        print("error: interrupted (exit 130); the same command resumes from the newest checkpoint", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second one waits for the end too
            signal.signal(sig, signal.SIG_IGN)
        process_tree.end_all()


def _drive() -> None:
    global _FULL_ERROR_SET
    try:
        sys.argv[1:] = hide_secrets(plain_group_overrides(sys.argv[1:]))
    except config.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    # `--cfg job` prints the config without running the app: an override it would show but no option reads is
    # refused here, as a run would refuse it.
    if any(a in ("-c", "--cfg") or a.startswith("--cfg=") for a in sys.argv[1:]):
        unread = readers.explain(sys.argv[1:])
        if unread:
            print(f"error: {unread}", file=sys.stderr)
            raise SystemExit(2)
    # Until the job starts, Hydra's errors (a bad override) come here rather than as its several lines.
    _FULL_ERROR_SET = FULL_ERROR_ENV not in os.environ
    if _FULL_ERROR_SET:
        os.environ[FULL_ERROR_ENV] = "1"
    try:
        _app()
    except Exception as e:
        if _job_started or not _FULL_ERROR_SET:
            raise
        print(f"error: {readers.explain(sys.argv[1:]) or composition_error(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    except SystemExit as e:
        # Hydra reports a composition error (unknown key, wrong type, missing option) as exit 1 before
        # any job starts; that is a config error like the others.
        if e.code == 1 and not _job_started:
            raise SystemExit(2) from None
        raise


if __name__ == "__main__":
    main()
