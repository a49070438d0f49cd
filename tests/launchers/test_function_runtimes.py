"""Function jobs on Kubeflow's non-torch runtimes, really run on this machine (`Client("local")`: a job's nodes
are processes here): JAX on 2 processes (a psum across them, and data-parallel linear regression with pmean'd
gradients ending at the one-process parameters), XGBoost on 2 workers (hist on row-split data: the one-worker
model), MLX on 2 ranks under mpirun (all_sum, and averaged-gradient training equal to one process); the runtime
verbs; packages_to_install in the job's own environment; and bad input refused in one line before anything
starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from launchers import Client, JobState, registry
from tests.conftest import REPO
from trainjob import runtimes


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
            json.dump({"psum": float(total[0]), "w": np.asarray(params["w"][0]).tolist(),
                       "b": float(params["b"][0]), "env": {k: v for k, v in os.environ.items() if k.startswith("JAX_")}},
                      f)
    jax.distributed.shutdown()


def xgboost_job(out):
    """XGBoost's hist on this worker's share of the rows, all workers joined through the job's tracker; rank 0
    writes the model's predictions on every row and its trees to `out`."""
    import json
    import os

    import numpy as np
    import xgboost as xgb

    from launchers.xgboost import tracker

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

    group = mx.distributed.init(strict=True, backend="mpi")
    rank, world = group.rank(), group.size()
    if world != int(os.environ["OMPI_COMM_WORLD_SIZE"]):
        raise RuntimeError(f"MPI world of {world}, not {os.environ['OMPI_COMM_WORLD_SIZE']}")
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
    assert two["psum"] == 3.0 and one["psum"] == 1.0
    assert two["env"]["JAX_NUM_PROCESSES"] == "2" and two["env"]["JAX_PROCESS_ID"] == "0"
    assert two["env"]["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    assert max(abs(a - b) for a, b in zip(two["w"] + [two["b"]], one["w"] + [one["b"]], strict=True)) < 1e-5
    assert abs(two["w"][0] - 1.5) < 0.05  # it did learn


@pytest.mark.timeout(120)
def test_xgboost_on_two_workers_builds_the_one_worker_model(home, tmp_path):
    pytest.importorskip("xgboost")
    client = Client("local")
    two = _run(client, xgboost_job, tmp_path / "two.json", runtime="xgboost-distributed", num_nodes=2)
    one = _run(client, xgboost_job, tmp_path / "one.json", runtime="xgboost-distributed", num_nodes=1)
    assert two["env"]["DMLC_NUM_WORKER"] == "2" and two["env"]["DMLC_TASK_ID"] == "0"
    assert two["env"]["DMLC_TRACKER_URI"] == "127.0.0.1" and two["env"]["DMLC_TRACKER_PORT"].isdigit()
    assert two["trees"] == one["trees"]
    assert max(abs(a - b) for a, b in zip(two["pred"], one["pred"], strict=True)) < 1e-6
