"""Function jobs of Kubeflow's non-torch runtimes on 2 Docker nodes against a real engine, in the image
`.ci/docker-image` builds (it holds the `runtimes` and `deepspeed` extras and Debian's libopenmpi-dev): the jobs of
tests/launchers/test_function_runtimes.py with the same checks, each against the same job in one process here. JAX
and XGBoost nodes are containers that meet at node 0's on Kubeflow's port 29500; MLX and DeepSpeed ranks start
under mpirun from a launcher container over SSH, as runtime=mpi's do. Also: packages_to_install in each node
container's own environment (and pip's failure, in one line); `get_runtime_packages` of the image, an
image without a runtime's framework refused in one line before any of the job's containers starts, and (e2e)
`launcher=docker runtime=deepspeed-distributed strategy=deepspeed runtime.nnodes=2` training as the local run does,
with its keys at Kubeflow's deepspeed runtime's sshAuthMountPath. They skip or fail on a missing engine or image as
tests/launchers/test_docker_engine.py's do."""

from __future__ import annotations

import json
import os

import pytest

from launchers import Client, JobState, LauncherError
from launchers.docker import ssh
from launchers.docker.backend import cpu_shares, host_cpus
from tests.conftest import REFERENCE, read_summary
from tests.launchers.test_docker_engine import IMAGE, docker, engine, job_name_of, leftovers, losses  # noqa: F401
from tests.launchers.test_function_runtimes import (  # noqa: F401
    _run,
    _wheel,
    check_jax,
    check_mlx,
    check_xgboost,
    deepspeed_job,
    home,
    jax_job,
    mlx_job,
    uses_package,
    xgboost_job,
)
from trainjob import runtimes

pytestmark = pytest.mark.slow


def _on_docker(func, run_dir, runtime: str) -> tuple[str, dict, list]:
    """`func` on 2 Docker nodes of `runtime`, writing `run_dir`/out.json: the job's name, what it wrote and its steps
    (name, container, device, device count; the job's containers are removed after)."""
    client = Client("docker", image=IMAGE)
    out = run_dir / "out.json"
    name = client.train(func=func, func_args={"out": str(out)}, runtime=runtime, num_nodes=2, run_dir=str(run_dir))
    try:
        info = client.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=180, polling_interval=0.5)
        logs = [line for step in info.steps for line in client.get_job_logs(name, step=step.name)]
        assert info.state == JobState.COMPLETE, "\n".join(logs[-60:])
        with open(out) as f:
            return name, json.load(f), [(s.name, s.pod_name, s.device, s.device_count) for s in info.steps]
    finally:
        client.delete_job(name)
        assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("home")
def test_jax_on_two_docker_nodes_sums_and_trains_as_one_process(tmp_path):
    pytest.importorskip("jax")
    name, two, steps = _on_docker(jax_job, tmp_path / "two", "jax-distributed")
    one = _run(Client("local"), jax_job, tmp_path / "one.json", runtime="jax-distributed", num_nodes=1)
    check_jax(two, one)
    assert two["env"]["JAX_COORDINATOR_ADDRESS"] == f"{name}-node-0:29500"  # Kubeflow's port, node 0's container
    cpus = str(len(cpu_shares(2, None, host_cpus())[0]))  # each node's own CPUs: its device, as a pod's CPU limit
    assert steps == [("node-0", f"{name}-node-0", "cpu", cpus), ("node-1", f"{name}-node-1", "cpu", cpus)]


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("home")
def test_xgboost_on_two_docker_nodes_builds_the_one_worker_model(tmp_path):
    pytest.importorskip("xgboost")
    name, two, _ = _on_docker(xgboost_job, tmp_path / "two", "xgboost-distributed")
    one = _run(Client("local"), xgboost_job, tmp_path / "one.json", runtime="xgboost-distributed", num_nodes=1)
    check_xgboost(two, one)
    assert (two["env"]["DMLC_TRACKER_URI"], two["env"]["DMLC_TRACKER_PORT"]) == (f"{name}-node-0", "29500")


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("home")
def test_mlx_on_two_docker_nodes_under_mpirun_sums_and_trains_as_one_rank(tmp_path):
    pytest.importorskip("mlx.core")
    if runtimes.get("mlx-distributed").missing():
        pytest.skip(runtimes.get("mlx-distributed").missing())
    name, two, steps = _on_docker(mlx_job, tmp_path / "two", "mlx-distributed")
    one = _run(Client("local"), mlx_job, tmp_path / "one.json", runtime="mlx-distributed", num_nodes=1)
    check_mlx(two, one)
    # mlx-distributed's launcher is no MPI host (it has no CPUs of its own): mpirun reaches the 2 node containers.
    cpus = str(len(cpu_shares(2, None, host_cpus())[0]))
    assert steps == [("node-0", f"{name}-launcher", "Unknown", "Unknown"), ("node-1", f"{name}-node-0", "cpu", cpus),
                     ("node-2", f"{name}-node-1", "cpu", cpus)]


@pytest.mark.timeout(240)
def test_deepspeed_init_distributed_on_two_docker_nodes_joins_from_mpis_environment(tmp_path):
    name, two, steps = _on_docker(deepspeed_job, tmp_path / "two", "deepspeed-distributed")
    assert two == {"sum": 3.0, "world": 2, "port": "29500"}  # Kubeflow's port, at node 0's container
    assert [s[:2] for s in steps] == [("node-0", f"{name}-launcher"), ("node-1", f"{name}-node-0")]


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("home")
@pytest.mark.e2e
def test_packages_to_install_go_into_each_node_containers_own_environment_and_a_pip_failure_fails_the_job(tmp_path):
    """Each node container makes an environment of its own in its HOME (the image's is root's), pip-installs the job's
    packages there and runs its ranks in it: XGBoost's 2 node containers each; under mpirun (runtime=mpi, 2 hosts of
    2 ranks) once on each host, not once per rank. A package pip cannot find fails the job with pip's one line,
    through mpirun too. The containers reach no index: the wheel is a file of the run directory, which they mount."""
    client = Client("docker", image=IMAGE, env={"PIP_NO_INDEX": "1"})
    jobs = {}
    for runtime, nproc in (("xgboost-distributed", 1), ("mpi", 2)):
        run_dir = tmp_path / runtime
        run_dir.mkdir()
        _wheel(run_dir, "trainjob_probe", runtime)
        jobs[runtime] = client.train(func=uses_package, runtime=runtime, num_nodes=2, nproc_per_node=nproc,
                                     packages_to_install=[str(run_dir / "trainjob_probe-0.1-py3-none-any.whl")],
                                     run_dir=str(run_dir))
        jobs[f"bad {runtime}"] = client.train(func=uses_package, runtime=runtime, packages_to_install=[
            "no-such-dist-xyz"], run_dir=str(tmp_path / f"bad-{runtime}"))
    try:
        final = {key: client.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=180,
                                                 polling_interval=0.5) for key, name in jobs.items()}
        logs = {key: [line for s in info.steps for line in client.get_job_logs(info.name, step=s.name)]
                for key, info in final.items()}
        assert {key: info.state for key, info in final.items()} == {
            "xgboost-distributed": JobState.COMPLETE, "mpi": JobState.COMPLETE,
            "bad xgboost-distributed": JobState.FAILED, "bad mpi": JobState.FAILED}, logs
        installed = "installed {}/trainjob_probe-0.1-py3-none-any.whl into {}/venv"  # the container's HOME
        assert sorted(logs["xgboost-distributed"]) == sorted(
            [installed.format(tmp_path / "xgboost-distributed", "/home/trainjob"),
             "probe says xgboost-distributed"] * 2)
        said = [line for line in logs["mpi"] if line.startswith(("installed", "probe"))]  # not ssh's or sshd's
        # runtime=mpi's HOME holds its keys' .ssh (runtime.ssh_auth_mount_path=/root/.ssh, as Kubeflow's).
        assert sorted(said) == sorted([installed.format(tmp_path / "mpi", "/root")] * 2 + ["probe says mpi"] * 4)
        for key, hosts in (("bad xgboost-distributed", 1), ("bad mpi", 2)):  # the 1-node MPI job: node 0, launcher
            said = [line for line in logs[key] if line.startswith("error:")]
            assert said == ["error: pip could not install no-such-dist-xyz: Could not find a version that satisfies "
                            "the requirement no-such-dist-xyz (from versions: none)"] * hosts, logs[key]
    finally:
        for name in jobs.values():
            client.delete_job(name)
            assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))


def test_get_runtime_packages_on_docker_lists_what_the_image_holds():
    """Kubeflow's Container backend's command in a one-off container of the image: Python's version, pip list
    (with every runtime's framework: CI's image holds them), and no nvidia-smi on this CPU image."""
    shown = Client("docker", image=IMAGE).get_runtime_packages("jax-distributed")
    lines = shown.splitlines()
    assert lines[0].startswith("Python: 3.")
    listed = {line.split()[0].lower() for line in lines[3:-1]}  # pip list's rows (trainjob's: editable, 3 columns)
    assert {"torch", "jax", "jaxlib", "xgboost-cpu", "mlx", "deepspeed", "mpi4py", "trainjob"} <= listed, shown
    assert lines[-1] == "nvidia-smi not found"


@pytest.fixture(scope="module")
def image_without_frameworks():
    """The image without the runtimes' frameworks (mlx, jax, xgboost, deepspeed, mpi4py) and libmpi.so."""
    image, maker = "trainjob-test:no-frameworks", f"trainjob-test-no-frameworks-{os.getpid()}"
    # mlx-cpu leaves files of its own in mlx/, which would still import as a namespace package.
    strip = ("pip uninstall --yes --quiet mlx mlx-cpu jax jaxlib xgboost-cpu deepspeed mpi4py "
             "&& rm /usr/lib/*/libmpi.so "
             "&& rm -r \"$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')/mlx\"")
    made = docker("run", "--name", maker, "--user", "0:0", "--entrypoint", "", IMAGE, "sh", "-c", strip)
    try:
        assert made.returncode == 0, made.stderr
        assert docker("commit", maker, image).returncode == 0
    finally:
        docker("rm", "--force", maker)
    yield image
    docker("rmi", "--force", image)


@pytest.mark.parametrize("runtime, lacking, build", [
    ("jax-distributed", "jax", "trainjob's jax extra (pip install 'trainjob[jax]')"),
    ("xgboost-distributed", "xgboost", "trainjob's xgboost extra (pip install 'trainjob[xgboost]')"),
    ("mlx-distributed", "mlx and libmpi.so", "trainjob's mlx extra (pip install 'trainjob[mlx]') and Debian's "
                                             "libopenmpi-dev (its libmpi.so)"),
    ("deepspeed-distributed", "deepspeed and mpi4py", "trainjob's deepspeed extra (pip install 'trainjob[deepspeed]')"),
])
def test_an_image_without_the_runtimes_framework_is_refused_in_one_line(tmp_path, image_without_frameworks, runtime,
                                                                        lacking, build):
    """The job's first container (under MPI the one that makes its keys; else one that only looks) finds what the
    runtime's ranks import and load missing from the image: one line naming them and how to build an image with
    them; no container, network or key of the job is left."""
    run_dir = tmp_path / runtime
    with pytest.raises(LauncherError) as e:
        Client("docker", image=image_without_frameworks).train(func=uses_package, runtime=runtime, num_nodes=2,
                                                               run_dir=str(run_dir))
    assert str(e.value) == (f"launcher.image={image_without_frameworks} holds no {lacking}, which runtime={runtime} "
                            f"runs in every container: build it with {build}")
    name = job_name_of(str(run_dir))
    assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))


@pytest.mark.e2e  # a local DeepSpeed run and a Docker one of 2 nodes
def test_deepspeed_trains_on_two_docker_nodes_as_the_local_run_with_keys_at_kubeflows_mount_path(run_cli, tmp_path):
    """launcher=docker runtime=deepspeed-distributed strategy=deepspeed runtime.nnodes=2, its keys mounted where
    Kubeflow's deepspeed-distributed runtime mounts them (sshAuthMountPath /home/mpiuser/.ssh: sshd's host key and
    ssh's identity are read there, so the job runs only if they are), trains to the losses of the local 2-rank run."""
    deepspeed = ["runtime=deepspeed-distributed", "strategy=deepspeed"]
    local = run_cli(*REFERENCE, *deepspeed, "runtime.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stderr[-3000:]
    run_dir = tmp_path / "run"
    proc = run_cli(*REFERENCE, *deepspeed, "launcher=docker", "runtime.nnodes=2", "runtime.nproc_per_node=1",
                   f"launcher.image={IMAGE}", "runtime.ssh_auth_mount_path=/home/mpiuser/.ssh",
                   f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert losses(str(run_dir)) == pytest.approx(losses(str(tmp_path / "local")), rel=1e-5)
    assert read_summary(str(run_dir))["world_size"] == 2
    name = job_name_of(str(run_dir))
    assert leftovers(name) == [] and not os.path.exists(ssh.key_dir(name))
