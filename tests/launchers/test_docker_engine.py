"""The Docker launcher against a real Docker engine: real containers of the image built from this
repository's Dockerfile (`.ci/docker-image` builds `trainjob:test` on a Debian base made locally), on a real
bridge network of the job's own, running real torchrun and gloo ranks.

They skip, saying why, where no engine answers or the image is missing; where TRAINJOB_DOCKER_IMAGE is set
(CI exports it once it has built the image) they fail instead. The image's Python is Debian's, not this
host's, so its standard library (the default corpus's source) differs from the driver's: the runs below
train on the driver's corpus only because the ranks read the build the driver pinned.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from launchers import Client, JobState, LauncherError
from launchers import get as get_launcher
from launchers.docker.backend import RUN_LABEL, cpu_shares, host_cpus
from tests.conftest import REFERENCE, TINY, compose_run, read_metrics, read_summary
from trainjob.run_files import read_events

IMAGE = os.environ.get("TRAINJOB_DOCKER_IMAGE") or "trainjob:test"
NOBODY = 65534  # the invoking user of the test that runs the driver as another user
DOCKER = ["launcher=docker", "+runtime=torch-distributed", "runtime.nnodes=2", f"launcher.image={IMAGE}"]

pytestmark = pytest.mark.slow


def docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)


def _unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    info = docker("info", "--format", "{{.ServerVersion}}")
    if info.returncode != 0:
        return f"no Docker engine answers ({(info.stderr.strip().splitlines() or ['?'])[-1]})"
    if docker("image", "inspect", IMAGE).returncode != 0:
        return f"no image {IMAGE}: build it with .ci/docker-image"
    return None


@pytest.fixture(scope="module", autouse=True)
def engine():
    reason = _unavailable()
    if reason and os.environ.get("TRAINJOB_DOCKER_IMAGE"):
        pytest.fail(f"TRAINJOB_DOCKER_IMAGE is set and {reason}")
    if reason:
        pytest.skip(reason)


def leftovers(name: str) -> list[str]:
    """The containers of run `name` and its network, where any remain."""
    ps = docker("ps", "--all", "--filter", f"label={RUN_LABEL}={name}", "--format", "{{.Names}}")
    network = ["network " + name] if docker("network", "inspect", name).returncode == 0 else []
    return ps.stdout.split() + network


def losses(run_dir: str) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def same_run(run_dir: str, reference: str) -> None:
    assert losses(run_dir) == pytest.approx(losses(reference), rel=1e-6)
    assert read_summary(run_dir)["final_eval_loss"] == pytest.approx(read_summary(reference)["final_eval_loss"],
                                                                     rel=1e-6)


@pytest.mark.e2e
def test_two_nodes_train_as_local_torchrun_each_on_its_own_cpus_and_a_relaunch_resumes(run_cli, tmp_path,
                                                                                         ddp_reference):
    """2 nodes x 1 process, their batches from 2 cache containers, give the losses of local torchrun with 2
    processes: the driver's corpus, not the one the image's Python would make. Each node has CPUs of its own
    and a thread for each. Launched again (no cache nodes, 2 more steps), the run resumes, its ranks reading
    the driver's build: the image's Python makes another corpus, which they would refuse."""
    run_dir = tmp_path / "run"
    proc = run_cli(*REFERENCE, *DOCKER, "data.cache.nodes=2", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_run(str(run_dir), ddp_reference)
    shares = cpu_shares(2, None, host_cpus())
    for rank, cpus in enumerate(shares):  # rank r on node r: torchrun ranks the nodes by host name
        with open(run_dir / "logs" / f"rank-{rank}.log") as f:
            assert f", {len(cpus)} threads on CPUs {','.join(map(str, cpus))}" in f.read()
    assert len(host_cpus()) < 2 or not set(shares[0]) & set(shares[1])
    name = job_name_of(str(run_dir))
    assert leftovers(name) == []

    again = run_cli(*REFERENCE, *DOCKER, "train.max_steps=8", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    with open(run_dir / "logs" / "rank-0.log") as f:
        assert f"resumed from {run_dir / 'checkpoints' / 'step-6'} (step 6)" in f.read()
    summary = read_summary(str(run_dir))
    assert (summary["steps"], summary["steps_this_run"]) == (8, 2)
    assert [m["step"] for m in read_metrics(str(run_dir)) if "loss" in m] == list(range(1, 9))
    assert leftovers(name) == []


@pytest.mark.parametrize("runtime", [["+runtime=torch-distributed", "runtime.nnodes=1"],
                                     pytest.param(["runtime=mpi", "runtime.nnodes=2", "runtime.nproc_per_node=1"],
                                                  marks=pytest.mark.e2e)],  # MPI on Docker: test_docker_mpi.py
                         ids=["torchrun", "mpi"])
def test_the_containers_run_as_the_invoking_user_who_can_delete_the_run(tmp_path, runtime):
    """A driver run by user 65534 (in a container of the image, with the docker CLI and the engine's socket:
    this host's interpreter lies where only root may read) starts ranks that write the run directory as
    65534, who can then delete all of it. Under mpirun, ssh and sshd run as that user too (whose entry in the
    image names no shell: the job's passwd gives one), with keys in its own temporary directory."""
    top = tempfile.mkdtemp(prefix="trainjob-docker-", dir="/tmp")  # outside pytest's root-only directories
    try:
        source, run_dir = os.path.join(top, "docs.parquet"), os.path.join(top, "run")
        pq.write_table(pa.table({"text": [f"doc {i}: " + "lorem ipsum " * 20 for i in range(300)]}), source)
        os.chown(top, NOBODY, NOBODY)
        os.chown(source, NOBODY, NOBODY)
        socket = "/var/run/docker.sock"
        driver = ["python", "-m", "trainer", *TINY, "launcher=docker", f"launcher.image={IMAGE}", *runtime,
                  "data=parquet", f"data.path={source}",
                  "data.eval_percent=20", "train.max_steps=2", "train.checkpoint_every=1",
                  f"hydra.run.dir={run_dir}"]
        cli = shutil.which("docker")
        proc = docker("run", "--rm", "--user", f"{NOBODY}:{NOBODY}", "--group-add", str(os.stat(socket).st_gid),
                      "--volume", f"{socket}:{socket}", "--volume", f"{cli}:/usr/local/bin/docker:ro",
                      "--volume", f"{top}:{top}", "--workdir", top, "--env", f"HOME={top}", "--env", f"TMPDIR={top}",
                      "--env", f"TRAINJOB_CACHE={top}/cache", IMAGE, "sh", "-c",
                      f"{shlex.join(driver)} && ls -ln {run_dir}/checkpoints && rm -r {run_dir}")
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert "final eval loss:" in proc.stdout
        assert re.search(rf"\S+ +\d+ {NOBODY} +{NOBODY} .* step-2$", proc.stdout, re.MULTILINE), proc.stdout[-2000:]
        assert not os.path.exists(run_dir)  # the user deleted all of it, checkpoints and logs included
        assert not glob.glob(f"{top}/trainjob-ssh-{NOBODY}/*")  # an MPI job's keys went with it
        assert {p: os.lstat(p).st_uid for p in glob.glob(f"{top}/cache/**", recursive=True)
                if os.lstat(p).st_uid != NOBODY} == {}
        assert leftovers(job_name_of(run_dir)) == []
    finally:
        shutil.rmtree(top, ignore_errors=True)


def job_name_of(run_dir: str) -> str:
    from launchers.base import run_name

    return run_name(os.path.abspath(run_dir), max_len=49)


@pytest.mark.e2e
def test_a_node_that_fails_to_start_takes_the_others_and_the_network_with_it(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    name = job_name_of(str(run_dir))
    blocker = f"{name}-node-1"  # a container of that name, not the job's: docker refuses to start node 1
    assert docker("create", "--name", blocker, IMAGE, "true").returncode == 0
    try:
        proc = run_cli(*TINY, *DOCKER, "train.max_steps=2", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 1
        (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert error.startswith(f"error: docker could not start container {blocker}: ") and "Conflict" in error
        assert error.endswith("; removed what this launch had started")
        assert leftovers(name) == []  # node 0 and the network are gone
        assert docker("inspect", blocker).returncode == 0  # what was not the launch's stays
    finally:
        docker("rm", "--force", blocker)


def test_a_rank_whose_corpus_is_not_the_drivers_refuses_before_its_first_step(tmp_path):
    """The driver pins the corpus it checked; ranks that can neither read that build nor make it again
    (here its Parquet source changed after the driver checked it) refuse in one line, and train nothing."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    run_dir.mkdir()
    source = run_dir / "docs.parquet"  # in the run directory: the containers see it at the same path
    pq.write_table(pa.table({"text": [f"document {i}: " + "lorem ipsum dolor " * 12 for i in range(300)]}), source)
    # launcher.wait=false: no driver waits on this launch, so the rank prints its refusal into its own log.
    run = compose_run(tmp_path, *TINY, *DOCKER, "runtime.nnodes=1", "data=parquet", f"data.path={source}",
                      "data.eval_percent=20", f"data.cache_dir={cache}", "train.max_steps=2", "launcher.wait=false")
    pinned = run.spec.config["data"]["fingerprint"]  # the key of the build the driver checked
    assert [d for d in os.listdir(cache / "corpus") if not d.startswith(".")] == [f"parquet-{pinned}"]
    shutil.rmtree(cache / "corpus")
    os.utime(source, (source.stat().st_atime, source.stat().st_mtime + 60))  # the source is not what was checked

    job = get_launcher(run.launcher).launch(run.spec)
    lines = list(job.logs(0, follow=True))
    assert job.wait(timeout=120) == JobState.FAILED
    refusals = [line for line in lines if line.startswith("error: ")]
    assert len(refusals) == 1, lines[-20:]
    assert refusals[0].startswith(f"error: invalid config: data.fingerprint='{pinned}': the driver checked that "
                                  f"parquet corpus, and it is not in {cache / 'corpus'} here, where the source "
                                  "makes corpus ")
    assert (run_dir / "logs" / "rank-0.error").read_text() == refusals[0] + "\n"  # what a waiting driver prints
    assert not os.path.exists(run_dir / "metrics.jsonl")  # no step ran
    assert not os.path.exists(cache / "corpus") or os.listdir(cache / "corpus") == []  # nothing built
    assert leftovers(job.name) == []


@pytest.mark.e2e
def test_the_client_follows_a_job_and_a_dry_run_prints_what_a_launch_runs(run_cli, tmp_path, cache_dir,
                                                                          monkeypatch):
    run_dir = tmp_path / "run"
    overrides = [*TINY, "+runtime=torch-distributed", "runtime.nnodes=2", "train.max_steps=2"]
    # The Client launches with launcher.wait=false (nothing waits here, so the ranks report their own errors).
    dry = run_cli("launcher=docker", f"launcher.image={IMAGE}", *overrides, "launcher.wait=false",
                  "launcher.dry_run=true", f"hydra.run.dir={run_dir}")
    assert dry.returncode == 0, dry.stderr[-3000:]
    printed = [shlex.split(line) for line in dry.stdout.splitlines()]
    assert [c[:3] for c in printed] == [["docker", "network", "create"], *[["docker", "run", "--detach"]] * 2]

    monkeypatch.setenv("TRAINJOB_CACHE", cache_dir)
    client = Client("docker", image=IMAGE)
    name = client.train(*overrides, run_dir=str(run_dir))
    try:
        assert name == job_name_of(str(run_dir))
        # What runs is what the dry run printed: the network, then each container as its command says.
        network = json.loads(docker("network", "inspect", name).stdout)[0]
        assert printed[0] == ["docker", "network", "create", "--label", f"{RUN_LABEL}={network['Labels'][RUN_LABEL]}",
                              network["Name"]]
        for cmd in printed[1:]:
            assert_runs_as_printed(cmd)

        assert name in [j.name for j in client.list_jobs()]
        info = client.get_job(name)
        assert info.state in (JobState.CREATED, JobState.RUNNING, JobState.COMPLETE)
        assert info.run_dir == str(run_dir) and info.start_time is not None
        followed = list(client.get_job_logs(name, follow=True))  # until node 0's container has exited
        assert docker("inspect", "--format", "{{.State.Status}}", f"{name}-node-0").stdout.strip() == "exited"
        assert any("done: step 2" in line for line in followed), followed[-10:]
        done = client.wait_for_job_status(name, "Complete", timeout=120, polling_interval=0.5)
        assert (done.state, done.step) == (JobState.COMPLETE, 2) and done.eval_loss is not None
        assert done.end_time is not None and done.end_time >= done.start_time
    finally:
        client.delete_job(name)
    assert leftovers(name) == []
    with pytest.raises(LauncherError, match=f"no docker job '{name}'"):
        client.get_job(name)


def assert_runs_as_printed(cmd: list[str]) -> None:
    """The container that `cmd` (a printed `docker run --detach ...`) started has each of its options."""
    opts, at = {}, 3
    while cmd[at].startswith("--"):
        opts.setdefault(cmd[at], []).append(cmd[at + 1])
        at += 2
    image, args = cmd[at], cmd[at + 1:]
    (c,) = json.loads(docker("inspect", opts["--name"][0]).stdout)
    config, host = c["Config"], c["HostConfig"]
    assert (config["Image"], config["Entrypoint"] or [], config["Cmd"]) == (image, [], args)
    assert config["Hostname"] == opts["--hostname"][0] and host["NetworkMode"] == opts["--network"][0]
    assert config["User"] == opts["--user"][0] == f"{os.getuid()}:{os.getgid()}"
    assert set(opts["--env"]) <= set(config["Env"])
    assert {k: config["Labels"][k] for k in dict(x.split("=", 1) for x in opts["--label"])} == dict(
        x.split("=", 1) for x in opts["--label"])
    assert sorted(host["Binds"]) == sorted(opts["--volume"])
    assert host["CpusetCpus"] == opts["--cpuset-cpus"][0]
    path, options = opts["--tmpfs"][0].split(":", 1)
    assert host["Tmpfs"] == {path: options}
    assert host["ShmSize"] == 8 * 2**30 and opts["--shm-size"] == ["8g"]
    assert config["StopTimeout"] == int(opts["--stop-timeout"][0]) == 30  # train.preemption_grace_s
    assert set(opts) == {"--name", "--hostname", "--network", "--user", "--tmpfs", "--label", "--shm-size",
                         "--stop-timeout", "--volume", "--env", "--cpuset-cpus"}


@pytest.mark.e2e  # two 24-step runs, a node killed (the layout: test_docker.py's elastic test)
def test_an_elastic_run_loses_a_node_container_and_ends_at_the_one_node_losses(cache_dir, tmp_path):
    """`runtime.nnodes=1:2` on Docker: the rendezvous store has a container of its own; node 1's container is
    killed at step 6 and node 0 re-forms alone, resumes from the newest checkpoint and ends at the losses of an
    uninterrupted one-node run (rel 1e-5), every step trained once."""
    import time

    steps = 24
    args = [*TINY, f"train.max_steps={steps}", f"train.eval_every={steps}", "train.checkpoint_every=1",
            "+runtime=torch-distributed", "runtime.nproc_per_node=1", "runtime.max_restarts=2",
            "runtime.last_call_timeout=3"]
    env = {**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    one = subprocess.run([sys.executable, "-m", "trainer", *args, "runtime.nnodes=1",
                          f"hydra.run.dir={tmp_path / 'one'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    run_dir = tmp_path / "run"
    driver = subprocess.Popen([sys.executable, "-m", "trainer", *args, "launcher=docker", f"launcher.image={IMAGE}",
                               "runtime.nnodes=1:2", f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    name = job_name_of(str(run_dir))
    deadline = time.monotonic() + 240
    while not any(m.get("world_size") == 2 and m["step"] >= 6 for m in _lines(str(run_dir))):
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[0][-3000:]
        time.sleep(0.2)
    assert docker("kill", f"{name}-node-1").returncode == 0
    out, _ = driver.communicate(timeout=300)
    assert driver.returncode == 0, out[-3000:]
    events = [e for e in read_events(str(run_dir)) if e["event"] == "reformation"]
    assert [(e["event"], e["world_size_before"], e["world_size_after"]) for e in events] == [("reformation", 2, 1)]
    assert [m["step"] for m in read_metrics(str(run_dir))] == list(range(1, steps + 1))
    ours, ref = read_summary(str(run_dir)), read_summary(str(tmp_path / "one"))
    for key in ("final_train_loss", "final_eval_loss"):
        assert ours[key] == pytest.approx(ref[key], rel=1e-5)
    assert leftovers(name) == []


def _lines(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):  # a line being written
                    out.append(json.loads(line))
    return out
