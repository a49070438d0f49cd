"""The Docker launcher's commands and what a real engine cannot show: what the launcher would run (the
network, one container per node, the mounts, each node's own GPUs and CPUs, the invoking user, torchrun's
rendezvous), and, against `fake_docker.py` (a test double of the docker CLI on PATH), what only the CLI's
callers see: GPUs this host does not have, secrets in the CLI's environment and never on its command lines,
the order in which cache nodes start, are polled and the ranks start. What a real engine does (a node that
fails to start, relaunching, the Client, real containers training) is tests/launchers/test_docker_engine.py's."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import stat
import sys

import pytest

from launchers import JobState, LauncherError
from launchers import get as get_launcher
from launchers.docker import ssh
from launchers.docker.backend import HOME, RDZV_PORT, cpu_shares, host_cpus, job_name
from tests.conftest import compose_run
from trainjob import runtimes


def make_run(tmp_path, *overrides: str):
    return compose_run(tmp_path, "launcher=docker", "+runtime=torch-distributed", *overrides)


def commands(run) -> list[list[str]]:
    return get_launcher(run.launcher).commands(run.spec)


def with_spec(run, **changes):
    return dataclasses.replace(run, spec=dataclasses.replace(run.spec, **changes))


def test_one_container_per_node_on_the_jobs_network(tmp_path):
    run = make_run(
        tmp_path,
        "runtime.nnodes=3",
        "launcher.gpus_per_node=2",
        "launcher.image=me/trainjob:1",
        "strategy=fsdp2",
        "train.global_batch_size=12",
        "+launcher.env.NCCL_DEBUG=WARN",
    )
    name = job_name(run.spec)
    cmds = commands(run)
    assert cmds[0] == ["docker", "network", "create", "--label", f"trainjob.run={name}", name]
    nodes = cmds[1:]
    assert len(nodes) == 3
    for i, cmd in enumerate(nodes):
        assert cmd[:4] == ["docker", "run", "--detach", "--name"] and cmd[4] == f"{name}-node-{i}"
        assert cmd[cmd.index("--network") + 1] == name
        assert cmd[cmd.index("--gpus") + 1] == f'"device={2 * i},{2 * i + 1}"'  # its own GPUs
        assert f"{run.spec.run_dir}:{run.spec.run_dir}" in cmd
        assert "NCCL_DEBUG=WARN" in cmd and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in cmd
        tail = cmd[cmd.index("me/trainjob:1") + 1 :]
        # The agent whose exit code is its failed rank's own (a refused config: 2), as on this machine.
        assert tail[:3] == ["python", "-m", "trainjob.runtimes.torch_distributed.torchrun"]
        assert "--nproc-per-node=2" in tail and "--nnodes=3" in tail
        assert f"--rdzv-endpoint={name}-node-0:{RDZV_PORT}" in tail and "--rdzv-backend=c10d" in tail
        assert tail[-3:] == ["-m", "trainer.worker", run.spec.config_path]
    assert os.path.isfile(run.spec.config_path)


def test_an_mpi_job_is_a_launcher_and_ssh_hosts_as_kubeflow_lays_them_out(tmp_path):
    """runtime=mpi: the job's keys made first (by the image, which must hold OpenMPI and sshd), then sshd in each
    node container and mpirun in the launcher's, which reads the hostfile Kubeflow mounts and its other settings
    from Kubeflow's OMPI_MCA_* environment (no --hostfile, no ssh options of its own); the keys are mounted at
    runtime.ssh_auth_mount_path (Kubeflow's default /root/.ssh, whose parent is then the containers' HOME); the
    ranks run on the first `nnodes` hosts, each on its own CPUs, and get the containers' environment through
    mpirun."""
    for as_node, nodes in (("true", 1), ("false", 2)):
        run = compose_run(tmp_path, "launcher=docker", "runtime=mpi", "runtime.nnodes=2", "runtime.nproc_per_node=1",
                          "launcher.image=me/trainjob:1", f"runtime.run_launcher_as_node={as_node}")
        name, keys = job_name(run.spec), ssh.key_dir(job_name(run.spec))
        cmds = commands(run)
        assert cmds[0][:9] == ["docker", "run", "--rm", "--name", f"{name}-ssh-keys", "--network", "none", "--user",
                               "0:0"] and f"{keys}:/ssh" in cmds[0]
        assert cmds[1][:3] == ["docker", "network", "create"]
        runs = cmds[2:]
        assert [c[c.index("--name") + 1] for c in runs] == [*(f"{name}-node-{i}" for i in range(nodes)),
                                                            f"{name}-launcher"]
        for cmd in runs[:-1]:
            sshd = ["/usr/sbin/sshd", "-D", "-e", "-f", "/root/.ssh/sshd_config"]
            assert cmd[cmd.index("me/trainjob:1") + 1:] == sshd
        for cmd in runs:
            assert f"{keys}:/root/.ssh:ro" in cmd and f"{keys}/passwd:/etc/passwd:ro" in cmd
            assert f"{keys}/ssh_config:/etc/ssh/ssh_config:ro" in cmd
            assert "HOME=/root" in cmd and cmd[cmd.index("--tmpfs") + 1].startswith("/root:uid=")
        launcher = runs[-1]
        assert f"{keys}/hostfile:/etc/mpi/hostfile:ro" in launcher
        ompi = [e for i, e in enumerate(launcher) if launcher[i - 1] == "--env" and e.startswith("OMPI_MCA_")]
        assert ompi == ["OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile", "OMPI_MCA_orte_keep_fqdn_hostnames=true",
                        "OMPI_MCA_orte_set_default_slots=1", "OMPI_MCA_plm_rsh_args=-o ConnectionAttempts=10"]
        assert not any(e.startswith("OMPI_MCA_") for c in runs[:-1] for e in c)  # the launcher's alone, as upstream
        tail = launcher[launcher.index("me/trainjob:1") + 1:]
        assert tail[:3] == ["mpirun", "-np", "2"] and "--hostfile" not in tail and "--mca" not in tail
        assert not any(e.startswith("OMPI_MCA_") for e in tail)  # not passed on to the ranks by -x
        # Rank 0 runs where mpirun fills slots first: its own host, where the launcher is one.
        first = f"{name}-launcher" if as_node == "true" else f"{name}-node-0"
        assert f"MASTER_ADDR={first}" in tail and all(f in tail for f in ("HOME", "PATH", "OMP_NUM_THREADS"))
        assert tail[-3:] == ["-m", "trainer.worker", run.spec.config_path]
        shares = [",".join(map(str, s)) for s in cpu_shares(2, None, host_cpus())]
        ranks = [runs[-1], runs[0]] if as_node == "true" else runs[:-1]
        assert [c[c.index("--cpuset-cpus") + 1] for c in ranks] == shares
        assert as_node == "true" or "--cpuset-cpus" not in launcher  # mpirun alone, no rank


def test_the_jobs_keys_are_mounted_at_runtime_ssh_auth_mount_path_where_ssh_and_sshd_find_them(tmp_path):
    """runtime.ssh_auth_mount_path=/home/mpiuser/.ssh (Kubeflow's deepspeed runtime's): every container mounts the
    keys there, its HOME is /home/mpiuser, and sshd's and ssh's configurations name the keys there; a path that is
    not a `.ssh` directory keeps HOME and is still where sshd and ssh look."""
    for path, home in (("/home/mpiuser/.ssh", "/home/mpiuser"), ("/etc/job-keys", HOME)):
        run = compose_run(tmp_path, "launcher=docker", "runtime=deepspeed-distributed", "strategy=deepspeed",
                          "runtime.nnodes=2", "runtime.nproc_per_node=1", "launcher.image=me/trainjob:1",
                          f"runtime.ssh_auth_mount_path={path}")
        name, keys = job_name(run.spec), ssh.key_dir(job_name(run.spec))
        runs = [c for c in commands(run) if c[1] == "run" and "--detach" in c]
        for cmd in runs:
            assert f"{keys}:{path}:ro" in cmd and f"HOME={home}" in cmd
        assert runs[0][-5:] == ["/usr/sbin/sshd", "-D", "-e", "-f", f"{path}/sshd_config"]
        assert commands(run)[0][-6] == home  # the home of the passwd entry the keys container writes
        lay = ssh.layout(name, runtimes.get("deepspeed-distributed"), 2, True, path, HOME)
        assert (lay.hosts, lay.home) == ([f"{name}-node-0", f"{name}-launcher"], home)
        ssh.make_key_dir(name, lay, 1)
        try:
            with open(os.path.join(keys, "sshd_config")) as f:
                sshd = f.read()
            with open(os.path.join(keys, "ssh_config")) as f:
                client = f.read()
        finally:
            ssh.remove_key_dir(name)
        assert f"HostKey {path}/id_rsa\n" in sshd and f"AuthorizedKeysFile {path}/authorized_keys\n" in sshd
        assert f"PidFile {home}/sshd.pid\n" in sshd
        assert client == (f"Host *\n    Port 2222\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n"
                          f"    IdentityFile {path}/id_rsa\n")


def test_a_process_per_node_runtimes_nodes_are_containers_meeting_at_node_0_on_kubeflows_port(tmp_path):
    """jax-distributed and xgboost-distributed function jobs: node i's container runs the function once, with the
    environment Kubeflow's plugin gives pod i (its index, the node count, node 0's container on port 29500)."""
    from launchers.base import LaunchSpec, RuntimeSpec
    from launchers.docker.backend import DockerLauncher

    launcher = DockerLauncher({"image": "me/trainjob:1", "network": None, "gpus_per_node": 0, "cpus_per_node": None,
                               "shm_size": "1g", "env": {}})
    script = str(tmp_path / "train_func.py")
    for runtime, want in (("jax-distributed", ["JAX_NUM_PROCESSES=2", "JAX_COORDINATOR_ADDRESS={node0}:29500",
                                               "JAX_PROCESS_ID={i}"]),
                          ("xgboost-distributed", ["DMLC_TRACKER_URI={node0}", "DMLC_TRACKER_PORT=29500",
                                                   "DMLC_NUM_WORKER=2", "DMLC_TASK_ID={i}"])):
        spec = LaunchSpec(run_dir=str(tmp_path / runtime), command=[script], nnodes=2,
                          runtime=RuntimeSpec.of(runtime))
        name = job_name(spec)
        runs = [c for c in launcher.commands(spec) if c[1] == "run" and "--detach" in c]
        assert [c[c.index("--name") + 1] for c in runs] == [f"{name}-node-0", f"{name}-node-1"]
        for i, cmd in enumerate(runs):
            env = [w.format(node0=f"{name}-node-0", i=i) for w in want]
            assert cmd[cmd.index("me/trainjob:1") + 1:] == ["env", *env, "python", script]


def test_each_node_gets_its_own_cpus_and_runs_as_the_invoking_user(tmp_path):
    cpus = host_cpus()
    for overrides, per_node in (([], max(1, len(cpus) // 2)), (["launcher.cpus_per_node=1"], 1)):
        run = make_run(tmp_path, "runtime.nnodes=2", "runtime.nproc_per_node=1", *overrides)
        nodes = [c for c in commands(run) if c[1] == "run"]
        shares = [c[c.index("--cpuset-cpus") + 1] for c in nodes]
        assert shares == [",".join(map(str, s)) for s in cpu_shares(2, per_node, cpus)]
        assert len(shares[0].split(",")) == per_node and (len(cpus) < 2 or not set(shares[0]) & set(shares[1]))
        for cmd in nodes:
            assert f"OMP_NUM_THREADS={per_node}" in cmd
            assert cmd[cmd.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
            assert cmd[cmd.index("--tmpfs") + 1] == f"{HOME}:uid={os.getuid()},gid={os.getgid()},mode=0700"
            assert f"HOME={HOME}" in cmd
    two = make_run(tmp_path, "runtime.nnodes=1", "runtime.nproc_per_node=2", f"launcher.cpus_per_node={len(cpus)}")
    assert f"OMP_NUM_THREADS={max(1, len(cpus) // 2)}" in commands(two)[-1]  # a rank's share of its node's


def test_more_cpus_than_the_host_has_are_refused_before_anything_starts(tmp_path, docker):
    _, _, calls = docker
    n = len(host_cpus())
    run = make_run(tmp_path, "runtime.nnodes=1", f"launcher.cpus_per_node={n + 1}")
    with pytest.raises(LauncherError, match=f"runtime.nnodes=1 x {n + 1} CPUs per node .* = {n + 1} CPUs, and this "
                       f"process may use {n} of this host's"):
        get_launcher(run.launcher).launch(run.spec)
    assert calls() == []


def test_existing_network_and_no_gpus(tmp_path):
    cmds = commands(make_run(tmp_path, "launcher.network=lab", "runtime.nnodes=2"))
    assert all(c[1] == "run" for c in cmds)
    assert all("--gpus" not in c and c[c.index("--network") + 1] == "lab" for c in cmds)


def test_dry_run_prints_the_commands(run_cli, tmp_path):
    proc = run_cli(
        "launcher=docker", "+runtime=torch-distributed", "runtime.nnodes=2", "launcher.dry_run=true", timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert [line[:3] for line in lines] == [
        ["docker", "network", "create"],
        ["docker", "run", "--detach"],
        ["docker", "run", "--detach"],
    ]
    assert not (tmp_path / "outputs").exists()


@pytest.fixture
def docker(tmp_path, monkeypatch):
    """`docker` (and a 4-GPU `nvidia-smi`) on PATH as test doubles; returns (state, calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    double = os.path.join(os.path.dirname(__file__), "fake_docker.py")
    for name, body in (
        ("docker", f'exec {sys.executable} {double} "$@"'),
        ("nvidia-smi", 'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done'),
    ):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    state, log = tmp_path / "docker-state.json", tmp_path / "docker-calls.jsonl"
    state.write_text(json.dumps({"containers": {}, "networks": []}))
    log.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(state))
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(log))

    def read_state():
        return json.loads(state.read_text())

    def set_state(**changes):
        state.write_text(json.dumps({**read_state(), **changes}))

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()]

    return read_state, set_state, calls


def test_a_relaunch_removes_the_last_attempts_containers_and_finished_jobs_clean_up(tmp_path, docker):
    read_state, set_state, calls = docker
    run = with_spec(make_run(tmp_path, "runtime.nnodes=2"), secrets={"TRAINJOB_CACHE_TOKEN": "s3cret"})
    name = job_name(run.spec)
    launcher = get_launcher(run.launcher)
    set_state(
        containers={
            f"{name}-node-0": {"state": "exited", "labels": {"trainjob.run": name}},
            "someone-else": {"state": "exited", "labels": {"trainjob.run": "other"}},
        },
        networks=[name],
    )
    job = launcher.launch(run.spec)
    assert set(read_state()["containers"]) == {f"{name}-node-0", f"{name}-node-1", "someone-else"}
    runs = [c for c in calls() if c["argv"][0] == "run"]
    assert len(runs) == 2 and all(c["token"] == "s3cret" for c in runs)  # from the environment ...
    assert all("s3cret" not in " ".join(c["argv"]) for c in calls())  # ... never on a command line
    assert all(c["argv"][c["argv"].index("TRAINJOB_CACHE_TOKEN") - 1] == "--env" for c in runs)

    with pytest.raises(LauncherError, match="still running"):
        launcher.launch(run.spec)  # node containers of this run are running

    job.poll_seconds = 0.01
    assert job.wait(timeout=10) == JobState.COMPLETE
    assert set(read_state()["containers"]) == {"someone-else"} and read_state()["networks"] == []
    assert job.status() == JobState.COMPLETE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["runtime.nnodes=2", "launcher.gpus_per_node=4"], "= 8 GPUs, and this host has 4"),
    ],
)
def test_what_docker_would_misread_is_refused_before_anything_starts(tmp_path, docker, overrides, message):
    _, _, calls = docker
    run = make_run(tmp_path, *overrides)
    with pytest.raises(LauncherError, match=message.replace("(", r"\(")):
        get_launcher(run.launcher).launch(run.spec)
    assert not any(c["argv"][0] in ("run", "network") for c in calls())


def test_a_run_directory_with_a_colon_is_refused(tmp_path):
    run = make_run(tmp_path)
    with pytest.raises(LauncherError, match="holds ':', which docker reads as a volume separator"):
        commands(with_spec(run, run_dir=str(tmp_path / "a:b")))


def test_cache_nodes_run_as_containers_and_the_ranks_start_once_they_serve(tmp_path, docker):
    read_state, _, calls = docker
    run = make_run(tmp_path, "runtime.nnodes=2", "data.cache.nodes=2", "data.cache.token=s3cret")
    name = job_name(run.spec)
    cmds = commands(run)
    caches = [c for c in cmds if "trainjob.role=cache" in c]
    assert [c[c.index("--name") + 1] for c in caches] == [f"{name}-cache-0", f"{name}-cache-1"]
    assert caches[1][caches[1].index("python") :] == [
        "python",
        "-m",
        "trainer.data.cache_node",
        run.spec.config_path,
        "--shard",
        "1/2",
        "--host",
        "0.0.0.0",
        "--port",
        "50051",
        "--eval-port",
        "50052",
    ]
    ranks = [c for c in cmds if "trainjob.role=node" in c]
    assert all(
        f"TRAINJOB_CACHE_ENDPOINTS=[grpc://{name}-cache-0:50051,grpc://{name}-cache-1:50051]" in c
        and f"TRAINJOB_CACHE_EVAL_ENDPOINTS=[grpc://{name}-cache-0:50052]" in c
        for c in ranks
    )
    assert all("s3cret" not in " ".join(c) for c in cmds)

    job = get_launcher(run.launcher).launch(run.spec)
    order = [
        c["argv"][0] + " " + (c["argv"][c["argv"].index("--name") + 1] if "--name" in c["argv"] else c["argv"][1])
        for c in calls()
        if c["argv"][0] in ("run", "exec")
    ]
    assert order == [
        f"run {name}-cache-0",
        f"run {name}-cache-1",
        f"exec {name}-cache-0",
        f"exec {name}-cache-0",
        f"exec {name}-cache-1",
        f"run {name}-node-0",
        f"run {name}-node-1",
    ]
    job.poll_seconds = 0.01
    assert job.wait(timeout=10) == JobState.COMPLETE
    assert read_state()["containers"] == {}  # the cache nodes went with the job


MISREAD = [
    (["launcher.image=--privileged"], "launcher.image='--privileged': launcher=docker needs an image reference"),
    (["hydra.run.dir=runs/a:b"], "a:b': must not hold ':' with launcher=docker"),
    (["launcher.cpus_per_node=0"], "launcher.cpus_per_node=0: must be >= 1, or null for an equal share"),
]


@pytest.fixture(scope="module")
def misread(run_cli_batch, tmp_path_factory) -> list:
    """Each MISREAD row run by the CLI in a directory of its own, all from one interpreter: (process, directory)."""
    dirs = [tmp_path_factory.mktemp("misread") for _ in MISREAD]
    procs = run_cli_batch([(["launcher=docker", "+runtime=torch-distributed", *overrides], d)
                           for (overrides, _), d in zip(MISREAD, dirs, strict=True)], timeout=120)
    return list(zip(procs, dirs, strict=True))


@pytest.mark.parametrize("row", range(len(MISREAD)), ids=[" ".join(o) for o, _ in MISREAD])
def test_what_docker_would_misread_ends_the_cli_with_exit_2_and_no_run_directory(misread, row):
    (proc, tmp_path), message = misread[row], MISREAD[row][1]
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.timeout(60)
def test_the_client_runs_a_function_on_docker_and_finds_its_jobs_by_their_containers(tmp_path, docker):
    from launchers import Client
    from tests.launchers.test_client import greet

    read_state, _, calls = docker
    client = Client("docker", image="me/trainjob:1")
    run_dir = tmp_path / "func"
    name = client.train(func=greet, func_args={"times": 1}, num_nodes=2, nproc_per_node=2, run_dir=str(run_dir))
    runs = [c["argv"] for c in calls() if c["argv"][0] == "run"]
    assert [r[r.index("--name") + 1] for r in runs] == [f"{name}-node-0", f"{name}-node-1"]
    for r in runs:
        assert r[-1] == str(run_dir / "train_func.py") and "--nproc-per-node=2" in r and "--nnodes=2" in r
        assert f"{run_dir}:{run_dir}" in r
    assert [j.name for j in client.list_jobs()] == [name]
    info = client.get_job(name)  # the double's containers have exited 0
    assert (info.state, info.run_dir) == (JobState.COMPLETE, str(run_dir))
    client.delete_job(name)
    assert read_state()["containers"] == {} and read_state()["networks"] == []
    with pytest.raises(LauncherError, match=f"no docker job '{name}' on this host"):
        client.get_job(name)


def test_an_elastic_run_has_its_rendezvous_store_in_a_container_of_its_own(tmp_path):
    run = make_run(tmp_path, "runtime.nnodes=1:3", "runtime.nproc_per_node=1", "launcher.image=me/trainjob:1",
                   "train.global_batch_size=6")
    name = job_name(run.spec)
    cmds = commands(run)
    store, nodes = cmds[1], cmds[2:]
    assert store[store.index("--name") + 1] == f"{name}-rdzv"
    agent = ["python", "-m", "trainjob.runtimes.torch_distributed.rendezvous"]
    assert store[store.index("me/trainjob:1") + 1:] == [*agent, f"0.0.0.0:{RDZV_PORT}"]
    assert len(nodes) == 3
    for cmd in nodes:
        tail = cmd[cmd.index("me/trainjob:1") + 1:]
        assert "--nnodes=1:3" in tail and f"--rdzv-endpoint={name}-rdzv:{RDZV_PORT}" in tail
        (conf,) = [a for a in tail if a.startswith("--rdzv-conf=")]
        assert "is_host=false" in conf and "last_call_timeout=5" in conf
