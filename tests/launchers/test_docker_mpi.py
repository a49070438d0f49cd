"""`launcher=docker runtime=mpi` against a real Docker engine: a launcher container whose real mpirun reaches
real sshd on port 2222 in the node containers of the image `.ci/docker-image` builds (with OpenMPI and sshd), as
Kubeflow lays an MPI job out, with a key pair made for the job at launch. The ranks train as the local
`runtime=mpi` run does; a node container killed mid-run ends the job in one line naming it, and the relaunch
resumes. They skip or fail on a missing engine or image as tests/launchers/test_docker_engine.py's do.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from launchers import Client, JobState
from launchers.docker import ssh
from tests.conftest import REFERENCE, TINY, read_metrics, read_summary
from tests.launchers.test_docker_engine import IMAGE, docker, engine, job_name_of, leftovers, losses  # noqa: F401

pytestmark = pytest.mark.slow

MPI_DOCKER = ["launcher=docker", "runtime=mpi", "runtime.nnodes=2", "runtime.nproc_per_node=1",
              f"launcher.image={IMAGE}"]
RTOL = 1e-6  # the same ranks and collectives as the local run: float32 rounding at most


def _driver(cache_dir: str, cwd, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TRAINJOB_CACHE": cache_dir,
                                                                     "PYTHONUNBUFFERED": "1"})


def _while_running(driver: subprocess.Popen, ready, timeout: float = 240):
    """`ready()`'s first true value, polled while the driver runs."""
    deadline = time.monotonic() + timeout
    while not (got := ready()):
        if driver.poll() is not None or time.monotonic() > deadline:
            out, err = driver.communicate()
            pytest.fail(f"the job ended or stalled before that: {(out + err)[-3000:]}")
        time.sleep(0.2)
    return got


def _public_key(name: str) -> str | None:
    try:
        with open(os.path.join(ssh.key_dir(name), "authorized_keys")) as f:
            return f.read() or None
    except OSError:
        return None


@pytest.mark.e2e  # a local run and two Docker jobs of two nodes
def test_two_nodes_reached_over_ssh_with_the_jobs_own_keys_train_as_the_local_mpi_run(run_cli, cache_dir, tmp_path):
    """2 nodes x 1 rank give the losses of the local 2-rank mpirun. While the job runs, its key pair (made at
    launch, not in the image) is what node 0's sshd on 2222 accepts from the launcher's mpirun, and the hostfile
    is Kubeflow's; once it ends the keys are gone, and the relaunch (which resumes) has a pair of its own."""
    local = run_cli(*REFERENCE, "runtime=mpi", "runtime.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stderr[-3000:]

    run_dir = tmp_path / "run"
    name = job_name_of(str(run_dir))
    driver = _driver(cache_dir, tmp_path, *REFERENCE, *MPI_DOCKER, "train.checkpoint_every=6",
                     f"hydra.run.dir={run_dir}")
    key = _while_running(driver, lambda: _public_key(name))
    assert key.startswith("ecdsa-sha2-nistp521 ") and key.rstrip().endswith(f" {name}")
    assert oct(os.stat(ssh.key_dir(name)).st_mode & 0o777) == "0o700"
    with open(os.path.join(ssh.key_dir(name), "hostfile")) as f:
        assert f.read() == f"{name}-node-0 slots=1\n{name}-launcher slots=1\n"
    node_log = _while_running(driver, lambda: "Accepted publickey" in (
        log := docker("logs", f"{name}-node-0").stderr) and log)
    assert "Server listening on 0.0.0.0 port 2222." in node_log
    out, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, (out + err)[-3000:]

    assert losses(str(run_dir)) == pytest.approx(losses(str(tmp_path / "local")), rel=RTOL)
    assert read_summary(str(run_dir))["final_eval_loss"] == pytest.approx(
        read_summary(str(tmp_path / "local"))["final_eval_loss"], rel=RTOL)
    assert read_summary(str(run_dir))["world_size"] == 2
    assert sorted(os.listdir(run_dir / "logs")) == ["rank-0.log", "rank-1.log"]
    assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))  # containers, network and keys gone
    image_home = docker("run", "--rm", "--entrypoint", "", IMAGE, "sh", "-c", "ls -A /root/.ssh /home 2>/dev/null")
    assert "id_rsa" not in image_home.stdout  # the image holds no key

    driver = _driver(cache_dir, tmp_path, *REFERENCE, *MPI_DOCKER, "train.max_steps=8",
                     f"hydra.run.dir={run_dir}")
    again = _while_running(driver, lambda: _public_key(name))
    out, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, (out + err)[-3000:]
    assert again != key  # the relaunch is another job: a pair of its own
    assert read_summary(str(run_dir))["resumed_from"] == str(run_dir / "checkpoints" / "step-6")
    assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))


@pytest.mark.e2e  # two Docker jobs of two nodes
def test_a_killed_node_container_ends_the_job_in_one_line_naming_it_and_the_relaunch_resumes(cache_dir, tmp_path):
    """Node 0's container killed mid-run: the driver exits non-zero within 60 s, its one error line naming the
    container, and nothing of the job is left (no container, network, key or process); the same command
    resumes from the newest checkpoint and trains every step once."""
    steps = 24
    args = [*TINY, f"train.max_steps={steps}", "train.eval_every=8", "train.checkpoint_every=4", *MPI_DOCKER,
            f"hydra.run.dir={tmp_path / 'run'}"]
    run_dir = tmp_path / "run"
    name = job_name_of(str(run_dir))
    driver = _driver(cache_dir, tmp_path, *args)
    _while_running(driver, lambda: (run_dir / "checkpoints" / "step-4" / ".metadata").exists())
    assert docker("kill", f"{name}-node-0").returncode == 0
    killed = time.monotonic()
    out, err = driver.communicate(timeout=120)
    assert time.monotonic() - killed < 60
    assert driver.returncode == 1, (out + err)[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: run {run_dir} ({name}) ended Failed: container {name}-node-0 exited with code "
                      f"137 (killed); see its logs: python -m launchers logs {name}"], err[-3000:]
    assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))
    assert max(m["step"] for m in read_metrics(str(run_dir))) < steps
    newest = max(int(m[1]) for d in os.listdir(run_dir / "checkpoints") if (m := re.fullmatch(r"step-(\d+)", d)))

    driver = _driver(cache_dir, tmp_path, *args)
    out, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, (out + err)[-3000:]
    summary = read_summary(str(run_dir))
    assert summary["resumed_from"] == str(run_dir / "checkpoints" / f"step-{newest}") and newest >= 4
    assert summary["steps"] == steps
    assert [m["step"] for m in read_metrics(str(run_dir)) if "loss" in m] == list(range(1, steps + 1))
    assert leftovers(name) == []


def allreduce_ranks(out):
    """torch.distributed over gloo with its rank from MPI's environment and rank 0's host from the launcher's
    (MASTER_ADDR); every rank prints its host and the sum, rank 0 writes them to `out`."""
    import json
    import os
    import socket

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    print(f"rank {rank} of {world}: sum {total.item():g}", flush=True)
    if rank == 0:
        ompi = [f"OMPI_MCA_{k}" for k in ("orte_default_hostfile", "orte_keep_fqdn_hostnames",
                                          "orte_set_default_slots", "plm_rsh_args")]
        with open(out, "w") as f:
            json.dump({"sum": total.item(), "hosts": hosts, "ompi": {k: os.environ.get(k) for k in ompi},
                       "home": os.environ["HOME"], "keys": sorted(os.listdir("/root/.ssh"))}, f)
    dist.destroy_process_group()


def test_an_mpi_function_job_runs_on_two_docker_nodes_and_its_launcher_step_holds_every_ranks_output(tmp_path):
    """Client("docker").train(func=..., runtime="mpi", num_nodes=2): mpirun in the launcher container, given no
    hostfile and no ssh option on its command line, reads them from Kubeflow's OMPI_MCA_* environment and reaches the
    node container's sshd with the job's keys, mounted at runtime.ssh_auth_mount_path (Kubeflow's default
    /root/.ssh); the 2 ranks (one a container each) all-reduce to 3; the steps are Kubeflow's (node-0 the launcher,
    node-1 the node) and node-0's log holds both ranks' lines."""
    client = Client("docker", image=IMAGE)
    out = tmp_path / "run" / "out.json"
    name = client.train(func=allreduce_ranks, func_args={"out": str(out)}, runtime="mpi", num_nodes=2,
                        run_dir=str(out.parent))
    try:
        info = client.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=120, polling_interval=0.5)
        assert info.state == JobState.COMPLETE, "\n".join(client.get_job_logs(name, step="node-0"))
        with open(out) as f:
            got = json.load(f)
        assert (got["sum"], got["hosts"]) == (3.0, [f"{name}-launcher", f"{name}-node-0"])  # the hostfile's hosts
        assert got["ompi"] == {"OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
                               "OMPI_MCA_orte_keep_fqdn_hostnames": "true", "OMPI_MCA_orte_set_default_slots": "1",
                               "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}
        assert got["home"] == "/root" and {"id_rsa", "authorized_keys", "ssh_config"} <= set(got["keys"])
        launched = json.loads(docker("inspect", "--format", "{{json .Config.Cmd}}", f"{name}-launcher").stdout)
        assert launched[:3] == ["mpirun", "-np", "2"] and not {"--hostfile", "--mca"} & set(launched)
        assert [(s.name, s.status, s.pod_name) for s in info.steps] == [
            ("node-0", JobState.COMPLETE, f"{name}-launcher"), ("node-1", JobState.RUNNING, f"{name}-node-0")]
        assert sorted(line for line in client.get_job_logs(name, step="node-0") if line.startswith("rank ")) == [
            "rank 0 of 2: sum 3", "rank 1 of 2: sum 3"]
        assert "Server listening on 0.0.0.0 port 2222." in "\n".join(client.get_job_logs(name, step="node-1"))
    finally:
        client.delete_job(name)
    assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))


def test_an_image_without_sshd_is_refused_in_one_line_before_anything_starts(run_cli, tmp_path):
    """The image every container runs must hold OpenMPI and sshd (`docker build --build-arg MPI=1`): one without
    sshd is refused by the job's first container, which makes its keys, and nothing of the job is left."""
    image = "trainjob-test:no-sshd"
    maker = f"trainjob-test-no-sshd-{os.getpid()}"
    assert docker("run", "--name", maker, "--user", "0:0", IMAGE, "rm", "/usr/sbin/sshd").returncode == 0
    try:
        assert docker("commit", maker, image).returncode == 0
        run_dir = tmp_path / "run"
        proc = run_cli(*TINY, "train.max_steps=2", *MPI_DOCKER, f"launcher.image={image}", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: launcher.image={image} holds no OpenMPI or no sshd, which runtime=mpi runs in every container: "
            "build it with docker build --build-arg MPI=1")
        name = job_name_of(str(run_dir))
        assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))
        assert not os.path.exists(run_dir / "metrics.jsonl")
    finally:
        docker("rm", "--force", maker)
        docker("rmi", "--force", image)
