"""The Docker launcher's commands. No Docker engine runs on these machines, so what is checked is what
the launcher would run: the network, one container per node, the mounts, GPUs and torchrun's rendezvous."""

from __future__ import annotations

import os
import shlex

from launchers.docker import RDZV_PORT, commands, job_name
from tests.conftest import compose_run


def make_run(tmp_path, *overrides: str):
    return compose_run(tmp_path, "launcher=docker", "+runtime=torch-distributed", *overrides)


def test_one_container_per_node_on_the_jobs_network(tmp_path):
    run = make_run(tmp_path, "runtime.nnodes=3", "launcher.gpus_per_node=2", "launcher.image=me/trainjob:1",
                   "strategy=fsdp2", "train.global_batch_size=12", "+launcher.env.NCCL_DEBUG=WARN")
    name = job_name(run)
    cmds = commands(run)
    assert cmds[0] == ["docker", "network", "create", "--label", f"trainjob.run={name}", name]
    nodes = cmds[1:]
    assert len(nodes) == 3
    for i, cmd in enumerate(nodes):
        assert cmd[:4] == ["docker", "run", "--detach", "--name"] and cmd[4] == f"{name}-node-{i}"
        assert cmd[cmd.index("--network") + 1] == name
        assert cmd[cmd.index("--gpus") + 1] == "2"
        assert f"{run.run_dir}:{run.run_dir}" in cmd
        assert "NCCL_DEBUG=WARN" in cmd and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in cmd
        tail = cmd[cmd.index("me/trainjob:1") + 1:]
        assert tail[0] == "torchrun"
        assert "--nproc-per-node=2" in tail and "--nnodes=3" in tail
        assert f"--rdzv-endpoint={name}-node-0:{RDZV_PORT}" in tail and "--rdzv-backend=c10d" in tail
        assert tail[-3:] == ["-m", "trainer.worker", run.config_path]
    assert os.path.isfile(run.config_path)


def test_existing_network_and_no_gpus(tmp_path):
    cmds = commands(make_run(tmp_path, "launcher.network=lab", "runtime.nnodes=2"))
    assert all(c[1] == "run" for c in cmds)
    assert all("--gpus" not in c and c[c.index("--network") + 1] == "lab" for c in cmds)


def test_dry_run_prints_the_commands(run_cli, tmp_path):
    proc = run_cli("launcher=docker", "+runtime=torch-distributed", "runtime.nnodes=2", "launcher.dry_run=true",
                   timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert [line[:3] for line in lines] == [["docker", "network", "create"], ["docker", "run", "--detach"],
                                            ["docker", "run", "--detach"]]
    assert not (tmp_path / "outputs").exists()
