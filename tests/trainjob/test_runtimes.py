"""The runtime units (`trainjob.runtimes`), read without starting anything: the command each builds for a node,
the environment contract its ranks read, the Kubeflow mlPolicy it maps to, and the rules on its keys. The runs
themselves are tests/trainer/test_mpi.py's (real mpirun and torchrun processes)."""

from __future__ import annotations

import pathlib

import pytest

from trainjob import runtimes
from trainjob.options import OptionError
from trainjob.runtimes import mpi, torch_distributed
from trainjob.runtimes.base import Nodes, Offers
from trainjob.runtimes.mpi import hosts

WORKER = ["-m", "trainer.worker", "/runs/a/config.yaml"]


def _options(name: str, **values) -> dict:
    from dataclasses import asdict

    return {**asdict(runtimes.get(name).schema()), **values}


def test_every_runtime_is_one_module_whose_name_is_its_runtime_and_whose_yaml_exists():
    from tests.conftest import REPO

    conf = pathlib.Path(REPO) / "conf" / "runtime"
    assert sorted(p.stem for p in conf.glob("*.yaml")) == sorted(runtimes.NAMES)
    for name in runtimes.NAMES:
        unit = runtimes.get(name)
        assert unit.name == name and unit.schema().name == name
        assert (conf / f"{name}.yaml").read_text().count(f"runtime_schema_{name}@_here_") == 1
    with pytest.raises(OptionError, match="runtime.name='jax': must be one of torch-distributed, mpi, "
                                          "jax-distributed, xgboost-distributed, mlx-distributed, "
                                          "deepspeed-distributed"):
        runtimes.get("jax")


def test_torchrun_on_one_node_is_standalone_and_several_meet_at_the_endpoint():
    unit = runtimes.get("torch-distributed")
    one = unit.node_command(_options("torch-distributed"), Nodes(WORKER, python="py", nproc_per_node=2,
                                                                   worker="trainer.worker"))
    assert one == ["py", "-m", "trainjob.runtimes.torch_distributed.torchrun", "--nproc-per-node=2", "--nnodes=1",
                   "--max-restarts=0", "--monitor-interval=0.1", "--standalone", *WORKER]
    elastic = unit.node_command(_options("torch-distributed"), Nodes(
        ["script.py"], nnodes=4, min_nodes=2, endpoint="store:29400", store_apart=True))
    assert elastic[:3] == ["python", "-m", "torch.distributed.run"] and "--nnodes=2:4" in elastic
    assert "--rdzv-endpoint=store:29400" in elastic
    assert "--rdzv-conf=is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5," \
           "reform_last_call_timeout=1,join_timeout=600" in elastic
    assert unit.agent_env({}) == torch_distributed.AGENT_ENV
    assert unit.rank_env({"RANK": "1"}) == {}  # torchrun's variables are torch.distributed's own
    # The worker is the caller's to name: a command the runtime is not told runs it gets plain torchrun.
    assert unit.node_command(_options("torch-distributed"), Nodes(WORKER))[:3] == ["python", "-m",
                                                                                  "torch.distributed.run"]
    assert unit.store_command("py", "h:1", "/runs/a") == [
        "py", "-m", "trainjob.runtimes.torch_distributed.rendezvous", "h:1", "--run-dir", "/runs/a"]
    assert runtimes.get("mpi").store_command("py", "h:1") is None and runtimes.get("mpi").ssh_hosts() is not None
    assert unit.ssh_hosts() is None


def test_mpirun_on_one_machine_forks_every_rank_and_gives_them_the_rendezvous():
    unit = runtimes.get("mpi")
    cmd = unit.node_command(_options("mpi", master_port=29511), Nodes(WORKER, python="py", nproc_per_node=3))
    assert cmd[:6] == ["mpirun", "-np", "3", "--bind-to", "none", "--oversubscribe"]
    assert cmd[-4:] == ["py", *WORKER]
    exports = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert exports == ["MASTER_ADDR=127.0.0.1", "MASTER_PORT=29511", "OMP_NUM_THREADS=1"]
    assert unit.agent_env({})["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


def test_mpirun_across_nodes_reads_kubeflows_environment_and_ssh_config_passing_the_environment_on():
    """Across hosts mpirun takes the hostfile and ssh's options from the launcher's OMPI_MCA_* environment, as
    Kubeflow's plugin sets it, and sshd's port from the hosts' ssh client configuration."""
    unit = runtimes.get("mpi")
    nodes = Nodes(WORKER, nnodes=2, nproc_per_node=2, hosts=("job-node-0", "job-node-1"), env_names=("TRAINJOB_CACHE",))
    cmd = unit.node_command(_options("mpi"), nodes)
    assert cmd[:5] == ["mpirun", "-np", "4", "--bind-to", "none"] and "--hostfile" not in cmd and "--mca" not in cmd
    assert hosts.launcher_env(2) == {
        "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile", "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
        "OMPI_MCA_orte_set_default_slots": "2", "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}
    assert "    Port 2222\n" in unit.ssh_hosts().ssh_config("/root/.ssh")
    exports = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert exports == ["MASTER_ADDR=job-node-0", "MASTER_PORT=29500", "OMP_NUM_THREADS=1", "TRAINJOB_CACHE"]
    assert unit.ssh_hosts().hostfile(["job-node-0", "job-node-1"], 2) == "job-node-0 slots=2\njob-node-1 slots=2\n"


def test_mpis_ssh_hosts_are_laid_out_as_kubeflows_plugin_does():
    ssh = runtimes.get("mpi").ssh_hosts()
    # runLauncherAsNode: the launcher is the last host and one node fewer starts; never fewer than one node.
    assert [ssh.node_hosts(n, True) for n in (1, 2, 3)] == [1, 1, 2]
    assert [ssh.node_hosts(n, False) for n in (1, 2, 3)] == [1, 2, 3]
    assert ssh.hosts(["j-node-0"], "j-launcher", True) == ["j-node-0", "j-launcher"]
    assert ssh.hosts(["j-node-0", "j-node-1"], "j-launcher", False) == ["j-node-0", "j-node-1"]
    # mpirun fills its own host's slots first (OpenMPI's daemon 0), wherever the hostfile lists it.
    assert ssh.placement(["j-node-0", "j-launcher"], "j-launcher") == ["j-launcher", "j-node-0"]
    assert ssh.placement(["j-node-0", "j-node-1"], "j-launcher") == ["j-node-0", "j-node-1"]
    config = ssh.sshd_config("/home/u/.ssh", "/home/u/sshd.pid").splitlines()
    assert {"Port 2222", "HostKey /home/u/.ssh/id_rsa", "AuthorizedKeysFile /home/u/.ssh/authorized_keys",
            "PasswordAuthentication no", "StrictModes no"} <= set(config)
    assert ssh.sshd_command("/home/u/.ssh") == ["/usr/sbin/sshd", "-D", "-e", "-f", "/home/u/.ssh/sshd_config"]


def test_an_mpi_rank_reads_openmpis_variables_as_torch_distributeds(tmp_path):
    unit = runtimes.get("mpi")
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    assert unit.rank_env(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                  "MASTER_PORT": "29600"}
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# Kubeflow's\njob-node-0-0.job slots=2\njob-launcher-0-0.job slots=2\n")
    kubeflow = {k: v for k, v in env.items() if not k.startswith("MASTER")}
    got = unit.rank_env({**kubeflow, "OMPI_MCA_orte_default_hostfile": str(hostfile)})
    # The launcher is a host (runLauncherAsNode): mpirun fills its own host's slots first, so rank 0 runs there.
    assert got["MASTER_ADDR"] == "job-launcher-0-0.job" and got["MASTER_PORT"] == "29500"
    hostfile.write_text("job-node-0-0.job slots=2\njob-node-0-1.job slots=2\n")  # the launcher runs no rank
    assert unit.rank_env({**kubeflow, "OMPI_MCA_orte_default_hostfile": str(hostfile)})["MASTER_ADDR"] == (
        "job-node-0-0.job")
    assert unit.rank_env({"RANK": "0"}) == {}  # not started by mpirun


def test_each_runtime_maps_to_kubeflows_mlpolicy():
    assert runtimes.get("torch-distributed").ml_policy(_options("torch-distributed"), 2, 4) == {
        "numNodes": 2, "torch": {"numProcPerNode": 4}}
    assert runtimes.get("mpi").ml_policy(_options("mpi"), 2, 4) == {"numNodes": 2, "mpi": {
        "numProcPerNode": 4, "mpiImplementation": "OpenMPI", "sshAuthMountPath": "/root/.ssh",
        "runLauncherAsNode": True}}


def test_packages_install_once_per_pod_and_under_mpi_once_on_each_host():
    pip = ["python", "-m", "pip", "install", "--quiet", "--no-warn-script-location", "--user", "boto3"]
    assert runtimes.get("jax-distributed").install_command(["boto3"], "python") == pip
    for name in ("mpi", "mlx-distributed", "deepspeed-distributed"):  # on every rank's host, not the launcher alone
        assert runtimes.get(name).install_command(["boto3"], "python") == [
            "mpirun", "--hostfile", "/etc/mpi/hostfile", "--map-by", "ppr:1:node", *pip], name


def test_mpi_jobs_are_fixed_size_and_several_nodes_need_a_launcher_that_reaches_them():
    unit = runtimes.get("mpi")
    with pytest.raises(OptionError, match=r"runtime.nnodes='1:4': runtime=mpi jobs are fixed-size"):
        unit.check(mpi.MPIConfig(nnodes="1:4"))
    with pytest.raises(OptionError, match="runtime.mpi_implementation='MPICH': must be OpenMPI"):
        unit.check(mpi.MPIConfig(mpi_implementation="MPICH"))
    for path in (".ssh", "/", "/home/my keys", "/a:b"):
        with pytest.raises(OptionError, match=rf"^invalid config: runtime.ssh_auth_mount_path='{path}': must be an "
                                              "absolute directory path below / without ':' or spaces, such as "
                                              "/root/.ssh$"):
            unit.check(mpi.MPIConfig(ssh_auth_mount_path=path))
    unit.check(mpi.MPIConfig(ssh_auth_mount_path="/home/mpiuser/.ssh"))
    with pytest.raises(OptionError, match="runtime.nnodes=2: runtime=mpi starts every node's ranks from one launcher"):
        unit.check_job(mpi.MPIConfig(nnodes=2), range(2, 3), Offers(runs_here=True))
    with pytest.raises(OptionError, match="runtime='mpi': .* which this launcher does not lay out"):
        unit.check_job(mpi.MPIConfig(), range(1, 2), Offers())
    unit.check_job(mpi.MPIConfig(), range(1, 2), Offers(runs_here=True))
    unit.check_job(mpi.MPIConfig(nnodes=2), range(2, 3), Offers(ssh_hosts=True))


def test_a_missing_mpirun_is_named_with_the_debian_package_that_holds_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert runtimes.get("mpi").missing() == ("runtime=mpi needs OpenMPI's mpirun, which is not on PATH: install the "
                                             "Debian package openmpi-bin (apt-get install -y openmpi-bin, as root)")


def test_deepspeed_distributed_starts_its_ranks_as_mpi_does_under_kubeflows_deepspeed_runtime(monkeypatch):
    unit, options = runtimes.get("deepspeed-distributed"), _options("deepspeed-distributed", master_port=29511)
    nodes = Nodes(WORKER, python="py", nproc_per_node=2)
    assert unit.node_command(options, nodes) == runtimes.get("mpi").node_command(options, nodes)
    assert unit.kubeflow_command(options, nodes) == runtimes.get("mpi").kubeflow_command(options, nodes)
    assert unit.rank_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h"})["RANK"] == "1"
    assert (unit.runtime_ref, unit.framework, unit.strategies, unit.owns) == (
        "deepspeed-distributed", "deepspeed", ("deepspeed",), ("deepspeed",))
    assert unit.ml_policy(options, 2, 4)["mpi"]["numProcPerNode"] == 4
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert unit.missing() == ("runtime=deepspeed-distributed needs deepspeed and mpi4py, not installed here: "
                              "install trainjob's deepspeed extra (DS_BUILD_OPS=0 pip install -e '.[deepspeed]')")
