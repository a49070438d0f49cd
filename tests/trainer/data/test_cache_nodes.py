"""A run's own data cache nodes (`data.cache.nodes`), and the cache token kept out of every file and
printout: real torchrun ranks reading from real Arrow Flight nodes that the local launcher starts."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from tests.conftest import DIST, REFERENCE, TINY, read_metrics, read_summary

TOKEN = "s3cret-t0ken-42"


def _losses(run_dir: str) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def _cache_node_pids(config_path: str) -> list[int]:
    pids = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"trainer.data.cache_node" in args and config_path.encode() in args:
            pids.append(int(cmdline.split("/")[2]))
    return pids


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_starts_its_cache_nodes_reads_from_them_and_stops_them(run_cli, tmp_path, ddp_reference):
    run_dir = tmp_path / "run"
    proc = run_cli(*REFERENCE, *DIST, "data.cache.nodes=2", f"data.cache.token={TOKEN}", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i in range(2):  # each node served its shard (its log says where)
        with open(run_dir / "logs" / f"cache-node-{i}.log") as f:
            assert "serving grpc+tcp://127.0.0.1:" in f.read()
    assert _cache_node_pids(str(run_dir / "config.yaml")) == []  # no node outlives the run
    with open(run_dir / "config.yaml") as f:
        saved = f.read()
    assert TOKEN not in saved and TOKEN not in proc.stdout + proc.stderr
    cache = yaml.safe_load(saved)["data"]["cache"]
    assert cache["token"] == "${oc.env:TRAINJOB_CACHE_TOKEN}"
    assert cache["endpoints"] == "${oc.decode:${oc.env:TRAINJOB_CACHE_ENDPOINTS}}"

    # The nodes give the batches the local corpus gives: the same run without them has the same losses.
    assert _losses(str(run_dir)) == pytest.approx(_losses(ddp_reference), rel=1e-6)
    assert read_summary(str(run_dir))["final_eval_loss"] == pytest.approx(
        read_summary(ddp_reference)["final_eval_loss"], rel=1e-6)


def test_the_cache_token_is_never_printed_or_written(run_cli, tmp_path):
    dry = run_cli("launcher=kubernetes", "+runtime=torch-distributed", "launcher.dry_run=true",
                  "data.cache.endpoints=[grpc://cache-0:50051]", "data.cache.eval_endpoints=[grpc://cache-0:50052]",
                  f"data.cache.token={TOKEN}", timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert TOKEN not in dry.stdout + dry.stderr
    assert "warning: data.cache.token goes in clear to grpc://cache-0:50051" in dry.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(dry.stdout)}
    assert sorted(docs) == ["ConfigMap", "Secret", "TrainJob", "TrainingRuntime"]  # the runtime: failure policies
    assert yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["data"]["cache"]["token"] == \
        "${oc.env:TRAINJOB_CACHE_TOKEN}"

    # A sweep: checked whole before any job runs and refused naming the job, without the token; no sweep
    # directory (multirun.yaml) is written.
    sweep = run_cli("-m", *TINY, "train.max_steps=0,1", "data.cache.endpoints=[grpc://127.0.0.1:1]",
                    f"data.cache.token={TOKEN}", f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=120)
    assert sweep.returncode == 2
    assert "error: sweep job 0 (train.max_steps=0), before any job ran: " in sweep.stderr
    assert TOKEN not in sweep.stdout + sweep.stderr
    assert not (tmp_path / "sweep").exists()


BAD = [
    (["data.cache.nodes=-1"], "data.cache.nodes=-1: must be >= 0"),
    (["data.cache.nodes=2", "data.cache.endpoints=[grpc://h:1]"], "leave data.cache.endpoints and eval_endpoints"),
    (["data.cache.tls_root_cert=/nonexistent/ca.pem"], "data.cache.tls_root_cert='/nonexistent/ca.pem': must be"),
]


@pytest.fixture(scope="module")
def bad_runs(run_cli_batch, tmp_path_factory) -> list:
    """Each BAD row run by the CLI, all from one interpreter."""
    return run_cli_batch([([*TINY, "train.max_steps=1", *overrides], tmp_path_factory.mktemp("bad"))
                          for overrides, _ in BAD], timeout=120)


@pytest.mark.parametrize("row", range(len(BAD)), ids=[" ".join(o) for o, _ in BAD])
def test_bad_cache_settings_are_refused(bad_runs, row):
    proc, message = bad_runs[row], BAD[row][1]
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1


def test_hide_secrets_reads_the_token_as_hydra_does(monkeypatch):
    from trainer.__main__ import hide_secrets

    monkeypatch.delenv("TRAINJOB_CACHE_TOKEN", raising=False)
    assert hide_secrets(["data.cache.token='a,b:c$d'", "train.max_steps=3"]) == [
        "data.cache.token=${oc.env:TRAINJOB_CACHE_TOKEN}", "train.max_steps=3"]
    assert os.environ["TRAINJOB_CACHE_TOKEN"] == "a,b:c$d"  # unquoted, as Hydra would have read it
    assert hide_secrets(["data.cache.token=null", "+data.cache.token=${oc.env:MINE}"]) == [
        "data.cache.token=null", "+data.cache.token=${oc.env:MINE}"]  # nothing to hide
    with pytest.raises(SystemExit) as refused:
        hide_secrets(["data.cache={token:x}"])
    assert refused.value.code == 2


def test_a_node_given_the_runs_endpoints_advertises_its_own_and_lists_them_all(monkeypatch):
    from omegaconf import OmegaConf

    from trainer.data.cache_node import _peers

    saved = OmegaConf.create({"data": {"cache": {"endpoints": "${oc.decode:${oc.env:TRAINJOB_CACHE_ENDPOINTS}}"}}})
    monkeypatch.delenv("TRAINJOB_CACHE_ENDPOINTS", raising=False)
    assert _peers(saved, 2) is None  # the launcher gave this node no list: no peers
    monkeypatch.setenv("TRAINJOB_CACHE_ENDPOINTS", "[grpc://j-cache-0.j-cache.ml.svc:50051,grpc://j-cache-1.j-cache.ml.svc:50051]")
    assert _peers(saved, 2) == ["j-cache-0.j-cache.ml.svc:50051", "j-cache-1.j-cache.ml.svc:50051"]
    assert _peers(saved, 3) is None  # not one per node
