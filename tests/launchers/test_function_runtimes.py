"""Function jobs on Kubeflow's non-torch runtimes, really run on this machine (`Client("local")`: a job's nodes
are processes here): JAX on 2 processes (a psum across them, and data-parallel linear regression with pmean'd
gradients ending at the one-process parameters), XGBoost on 2 workers (hist on row-split data: the one-worker
model), MLX on 2 ranks under mpirun (all_sum, and averaged-gradient training equal to one process), DeepSpeed's
init_distributed on 2 ranks under mpirun; the runtime
verbs; packages_to_install in the job's own environment; and bad input refused in one line before anything
starts."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import zipfile

import pytest

from launchers import Client, JobState, LauncherError, registry
from tests.conftest import REPO
from trainjob import runtimes
from trainjob.runtimes.base import KUBEFLOW_PORT


def jax_job(out):
    """psum of (rank + 1) across the processes, then 60 steps of linear regression whose gradients are
    pmean'd across them, each process on its half of the rows; rank 0 writes what it found to `out`."""
    import json
    import os

    import jax

    jax.config.update("jax_enable_x64", True)
    jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]))
    import jax.numpy as jnp
    import numpy as np

    rank, world = jax.process_index(), jax.process_count()
    total = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(jnp.array([rank + 1.0]))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3))
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3 + 0.01 * rng.normal(size=64)
    rows = slice(rank * 64 // world, (rank + 1) * 64 // world)

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    def step(p, x, y):
        grads = jax.lax.pmean(jax.grad(loss)(p, x, y), "i")
        return jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, grads)

    step = jax.pmap(step, axis_name="i")
    params = {"w": jnp.zeros((1, 3)), "b": jnp.zeros((1,))}
    for _ in range(60):
        params = step(params, x[rows][None], y[rows][None])
    print(f"process {rank} of {world}: psum {float(total[0]):g}", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            env = {k: v for k, v in os.environ.items() if k.startswith("JAX_")}
            json.dump({"psum": float(total[0]), "w": np.asarray(params["w"][0]).tolist(),
                       "b": float(params["b"][0]), "env": env}, f)
    jax.distributed.shutdown()


def xgboost_job(out):
    """XGBoost's hist on this worker's share of the rows, all workers joined through the job's tracker; rank 0
    writes the model's predictions on every row and its trees to `out`."""
    import json
    import os

    import numpy as np
    import xgboost as xgb

    from trainjob.runtimes.xgboost_distributed.tracker import tracker

    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 4))  # fewer rows than hist's 256 bins: every split the one-worker model has
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * rng.normal(size=240)
    with tracker() as rank:
        world = int(os.environ["DMLC_NUM_WORKER"])
        rows = slice(rank * 240 // world, (rank + 1) * 240 // world)
        booster = xgb.train({"tree_method": "hist", "max_depth": 3, "seed": 0}, xgb.DMatrix(x[rows], y[rows]), 8)
    print(f"worker {rank} of {world} done", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"pred": booster.predict(xgb.DMatrix(x)).tolist(), "trees": booster.get_dump(),
                       "env": {k: v for k, v in os.environ.items() if k.startswith("DMLC_")}}, f)


def mlx_job(out):
    """mx.distributed's all_sum over the MPI ranks (refusing a world of 1 in a job of several), then 50 steps of
    linear regression with all_sum-averaged gradients, each rank on its share of the rows; rank 0 writes them."""
    import json
    import os

    import mlx.core as mx
    import numpy as np

    started = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    # strict: no silent world of 1. One rank alone is a singleton group: MLX's MPI backend leaves a world of 1
    # without MPI_Finalize, which mpirun counts as a failure.
    group = mx.distributed.init(strict=True, backend="mpi") if started > 1 else mx.distributed.init(backend="ring")
    rank, world = group.rank(), group.size()
    if world != started:
        raise RuntimeError(f"MPI world of {world}, not {started}")
    total = mx.distributed.all_sum(mx.array([rank + 1.0]), group=group)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = (x @ np.array([1.5, -2.0, 0.5], dtype=np.float32) + 0.3).astype(np.float32)
    rows = slice(rank * 64 // world, (rank + 1) * 64 // world)
    xs, ys = mx.array(x[rows]), mx.array(y[rows])

    def loss(w, b):
        return mx.mean((xs @ w + b - ys) ** 2)

    w, b = mx.zeros((3,)), mx.zeros((1,))
    grad = mx.grad(loss, argnums=(0, 1))
    for _ in range(50):
        gw, gb = grad(w, b)
        gw, gb = mx.distributed.all_sum(gw, group=group) / world, mx.distributed.all_sum(gb, group=group) / world
        w, b = w - 0.1 * gw, b - 0.1 * gb
    mx.eval(w, b)
    print(f"rank {rank} of {world}: all_sum {total.item():g}", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"sum": total.item(), "w": np.array(w).tolist(), "b": np.array(b).tolist()}, f)


def deepspeed_job(out):
    """deepspeed.init_distributed() under mpirun (it finds its rank from MPI through mpi4py), an all_reduce of
    (rank + 1) over gloo; rank 0 writes the sum and the world to `out`. On the CPU, DeepSpeed's shared-memory
    all-reduce (which it would compile with g++ as its communication starts: minutes, and a failure where there is
    no g++, as in CI's image) is left out, as trainer/parallel/deepspeed.py does: gloo reduces."""
    import json
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: all_reduce {total.item():g}", flush=True)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"sum": total.item(), "world": dist.get_world_size(), "port": os.environ["MASTER_PORT"]}, f)
    dist.destroy_process_group()


def says_rank():
    import os

    print(f"rank {os.environ['OMPI_COMM_WORLD_RANK']} of {os.environ['OMPI_COMM_WORLD_SIZE']}", flush=True)


def uses_package():
    import trainjob_probe

    print(f"probe says {trainjob_probe.WORD}", flush=True)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    saved = os.environ.get(registry.HOME_ENV)
    os.environ[registry.HOME_ENV] = str(tmp_path_factory.mktemp("trainjob-home"))
    yield
    if saved is None:
        os.environ.pop(registry.HOME_ENV, None)
    else:
        os.environ[registry.HOME_ENV] = saved


def _run(client, func, out, **kwargs) -> dict:
    name = client.train(func=func, func_args={"out": str(out)}, run_dir=str(out.parent / out.stem), **kwargs)
    info = client.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=120, polling_interval=0.2)
    assert info.state == JobState.COMPLETE, "\n".join(client.get_job_logs(name))
    with open(out) as f:
        return json.load(f)


@pytest.mark.timeout(120)
def test_jax_on_two_processes_sums_and_trains_as_one(home, tmp_path):
    pytest.importorskip("jax")
    client = Client("local")
    two = _run(client, jax_job, tmp_path / "two.json", runtime="jax-distributed", num_nodes=2)
    one = _run(client, jax_job, tmp_path / "one.json", runtime="jax-distributed", num_nodes=1)
    check_jax(two, one)
    assert two["env"]["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")


def check_jax(two: dict, one: dict) -> None:
    """jax_job's results on 2 processes and on 1: the psums, process 0's environment, the same parameters."""
    assert two["psum"] == 3.0 and one["psum"] == 1.0
    assert two["env"]["JAX_NUM_PROCESSES"] == "2" and two["env"]["JAX_PROCESS_ID"] == "0"
    assert max(abs(a - b) for a, b in zip(two["w"] + [two["b"]], one["w"] + [one["b"]], strict=True)) < 1e-5
    assert abs(two["w"][0] - 1.5) < 0.05  # it did learn


@pytest.mark.timeout(120)
def test_xgboost_on_two_workers_builds_the_one_worker_model(home, tmp_path):
    pytest.importorskip("xgboost")
    client = Client("local")
    two = _run(client, xgboost_job, tmp_path / "two.json", runtime="xgboost-distributed", num_nodes=2)
    one = _run(client, xgboost_job, tmp_path / "one.json", runtime="xgboost-distributed", num_nodes=1)
    check_xgboost(two, one)
    assert two["env"]["DMLC_TRACKER_URI"] == "127.0.0.1" and two["env"]["DMLC_TRACKER_PORT"].isdigit()


def check_xgboost(two: dict, one: dict) -> None:
    """xgboost_job's results on 2 workers and on 1: worker 0's environment, the same trees and predictions."""
    assert two["env"]["DMLC_NUM_WORKER"] == "2" and two["env"]["DMLC_TASK_ID"] == "0"
    assert two["trees"] == one["trees"]
    assert max(abs(a - b) for a, b in zip(two["pred"], one["pred"], strict=True)) < 1e-6


@pytest.mark.timeout(120)
def test_mlx_on_two_mpi_ranks_sums_and_trains_as_one(home, tmp_path):
    pytest.importorskip("mlx.core")
    lacking = runtimes.get("mlx-distributed").missing()
    if lacking:  # CI installs libopenmpi-dev (.ci/run): there this runs
        pytest.skip(lacking)
    client = Client("local")
    two = _run(client, mlx_job, tmp_path / "two.json", runtime="mlx-distributed", num_nodes=2)
    one = _run(client, mlx_job, tmp_path / "one.json", runtime="mlx-distributed", num_nodes=1)
    check_mlx(two, one)


def check_mlx(two: dict, one: dict) -> None:
    """mlx_job's results on 2 ranks and on 1: the all_sums, the same parameters."""
    assert two["sum"] == 3.0 and one["sum"] == 1.0
    assert max(abs(a - b) for a, b in zip(two["w"] + two["b"], one["w"] + one["b"], strict=True)) < 1e-5
    assert abs(two["w"][0] - 1.5) < 0.05


@pytest.mark.timeout(180)
def test_deepspeed_on_two_mpi_ranks_joins_from_mpis_environment(home, tmp_path):
    pytest.importorskip("deepspeed")
    lacking = runtimes.get("deepspeed-distributed").missing()
    if lacking:
        pytest.skip(lacking)
    # DeepSpeed's own MPI discovery would meet at 29500, which other jobs here may hold: the ranks keep the free port
    # the local runtime chose.
    with socket.socket() as held:
        try:
            held.bind(("", KUBEFLOW_PORT))
            held.listen()
        except OSError:  # something else listens there already
            pass
        two = _run(Client("local"), deepspeed_job, tmp_path / "two.json", runtime="deepspeed-distributed",
                   nproc_per_node=2)
    assert two["port"] != str(KUBEFLOW_PORT)
    assert {k: two[k] for k in ("sum", "world")} == {"sum": 3.0, "world": 2}


@pytest.mark.timeout(60)
def test_an_mpi_jobs_steps_are_kubeflows_and_its_launcher_node_0_holds_every_ranks_output(home, tmp_path):
    """Kubeflow's SDK names an MPI job's launcher step node-0 and node pod i node-<i+1>: on 2 nodes of 2 ranks
    (the launcher a node: runLauncherAsNode) node-0's log is mpirun's, with all 4 ranks' lines, and node-1's holds
    the ranks placed on it (2 and 3); `python -m launchers get` and `logs --step` say the same."""
    if runtimes.get("mpi").missing():
        pytest.skip(runtimes.get("mpi").missing())
    client = Client("local")
    name = client.train(func=says_rank, runtime="mpi", num_nodes=2, nproc_per_node=2, run_dir=str(tmp_path / "r"))
    assert client.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=50).state == JobState.COMPLETE
    assert [(s.name, s.status, s.pod_name) for s in client.get_job(name).steps] == [
        ("node-0", JobState.COMPLETE, None), ("node-1", JobState.COMPLETE, None)]
    assert sorted(client.get_job_logs(name, step="node-0")) == [f"rank {r} of 4" for r in range(4)]
    assert list(client.get_job_logs(name, step="node-1")) == ["rank 2 of 4", "rank 3 of 4"]
    with pytest.raises(LauncherError, match=rf"^step='node-2': job {name} has steps node-0, node-1$"):
        client.get_job_logs(name, step="node-2")
    with pytest.raises(ValueError, match="^rank=1, step='node-0': give a rank or a step, not both$"):
        client.get_job_logs(name, rank=1, step="node-0")
    cli = [sys.executable, "-m", "launchers"]
    got = subprocess.run([*cli, "get", name], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert got.stdout.splitlines()[-2:] == ["step node-0: Complete", "step node-1: Complete"], got.stderr
    logs = subprocess.run([*cli, "logs", name, "--step", "node-1"], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert logs.stdout == "rank 2 of 4\nrank 3 of 4\n", logs.stderr


def _wheel(folder, name: str, word: str) -> None:
    """A one-module wheel, `name` 0.1, whose module says `word` (pip installs it from `folder`, no index)."""
    dist = f"{name}-0.1.dist-info"
    files = {f"{name}.py": f"WORD = {word!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.mark.timeout(120)
def test_packages_to_install_go_into_the_jobs_own_environment_and_a_pip_failure_fails_the_job(home, tmp_path,
                                                                                              monkeypatch):
    pytest.importorskip("xgboost")
    _wheel(tmp_path, "trainjob_probe", "hello")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network: pip finds the wheel here, and nothing else
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    client = Client("local")
    ok = client.train(func=uses_package, runtime="xgboost-distributed", num_nodes=2,
                      packages_to_install=["trainjob_probe"], run_dir=str(tmp_path / "ok"))
    bad = client.train(func=uses_package, runtime="xgboost-distributed", packages_to_install=["no-such-dist-xyz"],
                       run_dir=str(tmp_path / "bad"))
    assert client.wait_for_job_status(ok, status={"Complete", "Failed"}, timeout=90).state == JobState.COMPLETE
    assert [line for r in (0, 1) for line in client.get_job_logs(ok, rank=r)] == ["probe says hello"] * 2
    assert [(s.name, s.status) for s in client.get_job(ok).steps] == [("node-0", JobState.COMPLETE),
                                                                      ("node-1", JobState.COMPLETE)]
    assert list(client.get_job_logs(ok, step="node-1")) == ["probe says hello"]  # node 1's process: rank 1
    assert (tmp_path / "ok" / "venv" / "bin" / "python").exists()
    with pytest.raises(ImportError):
        __import__("trainjob_probe")  # this environment is untouched
    assert client.wait_for_job_status(bad, status={"Complete", "Failed"}, timeout=90).state == JobState.FAILED
    said = [line for line in client.get_job_logs(bad) if line.startswith("error:")]
    assert said == ["error: pip could not install no-such-dist-xyz: Could not find a version that satisfies the "
                    "requirement no-such-dist-xyz (from versions: none)"]


def make_adder(n):
    def add(x):
        return x + n
    return add


@pytest.mark.timeout(60)
def test_bad_function_jobs_are_refused_in_one_line_before_anything_is_written(home, tmp_path):
    client = Client("local")
    cases = [
        (dict(runtime="tensorflow"), "runtime='tensorflow': no such runtime; the runtimes are torch-distributed, mpi, "
                                     "jax-distributed, xgboost-distributed, mlx-distributed, deepspeed-distributed"),
        (dict(runtime="jax-distributed", num_nodes=0), "num_nodes=0: must be a whole number >= 1"),
        (dict(runtime="jax-distributed", packages_to_install="numpy"), "packages_to_install='numpy': must be a list"),
        (dict(runtime="jax-distributed", resources_per_node={"tpu": 1}), "resources_per_node: tpu: the keys are"),
        (dict(func=lambda: None, runtime="jax-distributed"), "func=<lambda>: give a function defined with def"),
        (dict(func=make_adder(1), runtime="jax-distributed"), "func=add: a closure over n, which its source alone"),
    ]
    if runtimes.get("deepspeed-distributed").missing():
        cases.append((dict(runtime="deepspeed-distributed"), "pip install 'trainjob[deepspeed]'"))
    for i, (kwargs, message) in enumerate(cases):
        kwargs = {"func": uses_package, **kwargs}
        with pytest.raises(ValueError, match=None) as e:
            client.train(run_dir=str(tmp_path / str(i)), **kwargs)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert not (tmp_path / str(i)).exists()
    refused = subprocess.run([sys.executable, "-m", "trainer", "runtime=jax-distributed"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith(
        "runtime='jax-distributed': runs a user's function, not a trainer run: Client.train(func=..., "
        "runtime='jax-distributed') or python -m launchers train --runtime jax-distributed script.py")


def test_the_runtime_verbs_list_all_six_with_kubeflows_framework_labels(home):
    client = Client("local")
    listed = {r.name: r.trainer.framework for r in client.list_runtimes()}
    assert listed == {"torch-distributed": "torch", "mpi": "mpi", "jax-distributed": "jax",
                      "xgboost-distributed": "xgboost", "mlx-distributed": "mlx", "deepspeed-distributed": "deepspeed"}
    jax = client.get_runtime("jax-distributed")
    assert (jax.trainer.image, jax.trainer.num_nodes, jax.function_only) == ("local", 1, True)
    k8s = Client("kubernetes").get_runtime("xgboost-distributed")
    assert k8s.trainer.image == "ghcr.io/kubeflow/trainer/xgboost-runtime"
    packages = client.get_runtime_packages("xgboost-distributed")
    assert packages.startswith(f"Python: {sys.version}") and "xgboost" in packages
    shown = subprocess.run([sys.executable, "-m", "launchers", "runtimes"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[:2] for line in shown.stdout.splitlines()[1:]] == [[n, f] for n, f in listed.items()]
    one = subprocess.run([sys.executable, "-m", "launchers", "runtimes", "jax-distributed", "--packages"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert one.returncode == 0 and "framework: jax" in one.stdout and "Python: " in one.stdout, one.stderr
    bad = subprocess.run([sys.executable, "-m", "launchers", "runtimes", "tensorflow"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: runtime='tensorflow': no such runtime")


def test_mlx_without_libmpi_is_refused_naming_the_debian_package(home, tmp_path, monkeypatch):
    from trainjob.runtimes import mlx_distributed

    monkeypatch.setattr(mlx_distributed, "has_libmpi", lambda: False)
    lacking = runtimes.get("mlx-distributed").missing()
    if importlib.util.find_spec("mlx") is not None:
        assert lacking == ("runtime=mlx-distributed needs OpenMPI's libmpi.so, which MLX loads (without it every rank "
                           "sees a world of 1): install the Debian package libopenmpi-dev (apt-get install -y "
                           "libopenmpi-dev, as root)")
    with pytest.raises(ValueError, match="^runtime=mlx-distributed needs "):
        Client("local").train(func=uses_package, runtime="mlx-distributed", num_nodes=2, run_dir=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()
