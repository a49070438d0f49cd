"""The Client and `python -m launchers`: real jobs on the local backend (real torchrun, a registry that
another process reads), bad input refused, and the Kubernetes backend through the real `kubernetes`
client against `fake_apiserver.FakeApiServer` (no API server can run here; the double validates each
TrainJob against the CRD schemas as the real one does)."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from launchers import Client, JobState, LauncherError, OptionError, registry
from tests.conftest import REPO, TINY, examples, read_summary
from tests.launchers import crds
from tests.launchers.fake_apiserver import FakeApiServer


def greet(times):
    """A function job: every rank joins the group and says who it is."""
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    for _ in range(times):
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: ranks sum to {total.item():g}")
    dist.destroy_process_group()


def nap(seconds):
    import time

    print("napping", flush=True)
    time.sleep(seconds)


@pytest.fixture(scope="module")
def home(tmp_path_factory, cache_dir):
    """A job registry of this module's own, and the shared corpus cache, for this process and its children."""
    saved = {k: os.environ.get(k) for k in (registry.HOME_ENV, "TRAINJOB_CACHE")}
    os.environ[registry.HOME_ENV] = str(tmp_path_factory.mktemp("trainjob-home"))
    os.environ["TRAINJOB_CACHE"] = cache_dir
    yield os.environ[registry.HOME_ENV]
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m launchers *args` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "launchers", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.timeout(60)
def test_launchers_never_import_the_trainer_or_torch():
    """`trainer` may import `launchers`, never the reverse; and submitting a job needs no GPU stack."""
    package = os.path.join(REPO, "launchers")
    for file in sorted(os.listdir(package)):
        if file.endswith(".py"):
            with open(os.path.join(package, file)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                assert not any(n == "trainer" or n.startswith("trainer.") for n in names), f"{file} imports {names}"
    probe = (
        "import sys, launchers, launchers.client, launchers.supervise, launchers.__main__; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trainer', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_local_overrides_job_and_function_job_under_torchrun(home, tmp_path):
    client = Client("local")
    run_dir = tmp_path / "run"
    name = client.train(
        *TINY,
        "+runtime=torch-distributed",
        "runtime.nproc_per_node=2",
        "train.max_steps=3",
        "train.eval_every=3",
        "train.eval_batches=1",
        run_dir=str(run_dir),
    )
    func = client.train(func=greet, func_args={"times": 2}, nproc_per_node=2, run_dir=str(tmp_path / "func"))
    assert {j.name for j in client.list_jobs()} >= {name, func}

    info = client.wait_for_job_status(name, timeout=240, polling_interval=0.2)
    summary = read_summary(str(run_dir))
    assert info.state == JobState.COMPLETE and info.run_dir == str(run_dir)
    assert info.step == 3 and info.eval_loss == summary["final_eval_loss"] and info.loss == summary["final_train_loss"]
    assert info.start_time <= info.end_time
    assert summary["world_size"] == 2
    assert any("done: step 3" in line for line in client.get_job_logs(name, rank=0))
    with open(run_dir / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    records = client.get_job_metrics(name)
    assert records == logged and [r["step"] for r in records][-1] == 3
    assert records[-1]["loss"] == pytest.approx(summary["final_train_loss"])
    assert any("done: step 3" in line for line in client.get_job_logs(name, rank=1))

    assert client.wait_for_job_status(func, timeout=120, polling_interval=0.2).state == JobState.COMPLETE
    for rank in (0, 1):
        lines = list(client.get_job_logs(func, rank=rank, follow=True))
        assert lines == [f"rank {rank} of 2: ranks sum to 1"] * 2
    with pytest.raises(RuntimeError, match=f"job {func} ended Complete, not Failed"):
        client.wait_for_job_status(func, status="Failed", timeout=5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_job_started_by_one_process_is_listed_followed_and_deleted_from_others(home, tmp_path):
    run_dir = tmp_path / "nap"
    start = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from launchers import Client
        from tests.launchers.test_client import nap
        print(Client("local").train(func=nap, func_args={{"seconds": 120}}, run_dir={str(run_dir)!r}))
    """)
    started = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert started.returncode == 0, started.stderr
    name = started.stdout.strip()  # the process that started it has ended; the job runs on

    listed = cli("list", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout.splitlines()[-1])["name"] == name
    assert json.loads(cli("get", name, "--json").stdout)["state"] == "Running"
    follow = subprocess.Popen(
        [sys.executable, "-m", "launchers", "logs", name, "--follow"], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert follow.stdout.readline() == "napping\n"  # live, while the job runs
    waited = cli("wait", name, "--timeout", "1", "--interval", "0.2")
    assert waited.returncode == 1 and f"job {name} is Running after 1 s, not Complete" in waited.stderr

    record = registry.load(name)
    deleted = cli("delete", name)
    assert deleted.returncode == 0 and deleted.stdout.strip() == f"deleted {name}"
    assert follow.wait(timeout=30) == 0  # following ends with the job
    assert not record.alive()
    assert not registry.group_alive(record.pid)  # torchrun and the rank went with it ...
    deadline = time.monotonic() + 10
    with pytest.raises(ProcessLookupError):  # ... and, once reaped, no process is left in its group
        while time.monotonic() < deadline:
            os.killpg(record.pid, 0)
            time.sleep(0.1)
    gone = cli("get", name)
    assert gone.returncode == 1 and gone.stderr.strip().startswith(f"error: no local job '{name}'")
    assert (run_dir / "train_func.py").exists()  # what the job wrote stays


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_whose_supervisor_was_killed_outright_counts_as_failed(home, tmp_path):
    client = Client("local")
    name = client.train(func=nap, func_args={"seconds": 120}, run_dir=str(tmp_path / "killed"))
    record = registry.load(name)
    assert client.get_job(name).state == JobState.RUNNING
    os.kill(record.pid, signal.SIGKILL)  # no exit code gets written
    deadline = time.monotonic() + 30
    while record.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        info = client.get_job(name)
        assert info.state == JobState.FAILED and info.end_time is not None
    finally:
        os.killpg(record.pid, signal.SIGKILL)  # torchrun, orphaned in the supervisor's session


@pytest.mark.timeout(120)
def test_bad_input_is_refused_with_a_clear_message(home, tmp_path):
    with pytest.raises(OptionError, match="launcher='slurm': must be one of local, docker, kubernetes"):
        Client("slurm")
    with pytest.raises(OptionError, match="launcher.namespace='a': unknown option of launcher=local"):
        Client("local", namespace="a")
    client = Client("local")
    with pytest.raises(ValueError, match="func must be a plain function"):
        client.train(func=print)
    with pytest.raises(ValueError, match="values must be literals"):
        client.train(func=nap, func_args={"seconds": object()})
    with pytest.raises(ValueError, match="num_nodes=2: launcher=local runs one node"):
        client.train(func=nap, num_nodes=2)
    with pytest.raises(ValueError, match="status='Done': must be among"):
        client.wait_for_job_status("x", status="Done")
    with pytest.raises(LauncherError, match="no local job 'absent'"):
        client.get_job("absent")
    with pytest.raises(ValueError, match=r"^invalid config: train.max_steps=0: must be > 0$"):
        client.train("train.max_steps=0", run_dir=str(tmp_path / "refused"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "the following arguments are required"),
        (["--namespace", "ml", "list"], 2, "--namespace is an option of --launcher kubernetes"),
        (["--local-run-root", "/runs", "list"], 2, "--local-run-root is an option of --launcher kubernetes"),
        (["metrics", "absent"], 1, "error: no local job 'absent'"),
        (["--launcher", "slurm", "list"], 2, "invalid choice: 'slurm'"),
        (["wait", "x", "--status", "Done"], 2, "invalid choice: 'Done'"),
        (["wait", "x", "--timeout", "0"], 2, "--timeout 0 and --interval 2 must be > 0"),
        (["logs", "x", "--rank", "-1"], 2, "--rank -1: must be >= 0"),
        (["delete", "absent"], 1, "error: no local job 'absent'"),
    ],
)
def test_cli_bad_input_exits_non_zero_with_one_clear_line(home, args, code, message):
    proc = cli(*args)
    assert proc.returncode == code and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def apiserver(tmp_path):
    with FakeApiServer() as server:
        with open(os.path.join(os.path.dirname(crds.DEFAULT_DIR), "runtimes", "torch_distributed.yaml")) as f:
            server.objects[("clustertrainingruntimes", "", "torch-distributed")] = yaml.safe_load(f)
        yield server, server.kubeconfig(str(tmp_path / "kubeconfig"))


@pytest.mark.timeout(180)
def test_kubernetes_backend_through_the_kubernetes_client(home, tmp_path, apiserver):
    server, kubeconfig = apiserver
    with pytest.raises(ValueError, match="image=None: launcher=kubernetes runs the function in a container"):
        Client("kubernetes", kubeconfig=kubeconfig).train(func=greet)
    client = Client("kubernetes", namespace="ml", kubeconfig=kubeconfig, poll_seconds=0.05, image="pytorch/pytorch:2")
    name = client.train("+runtime=torch-distributed", "optim.lr=1e-3", run_dir=str(tmp_path / "run"))
    config = yaml.safe_load(server.objects[("configmaps", "ml", f"{name}-config")]["data"]["config.yaml"])
    assert config["optim"]["lr"] == 1e-3 and config["run_dir"] == f"/workspace/runs/{name}"
    func = client.train(
        func=greet, func_args={"times": 1}, num_nodes=2, nproc_per_node=4, run_dir=str(tmp_path / "func")
    )
    trainer = server.objects[("trainjobs", "ml", func)]["spec"]["trainer"]  # valid: the double checked the CRD
    assert trainer["command"] == ["torchrun", "--max-restarts=0", "/etc/trainjob/train_func.py"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    shipped = server.objects[("configmaps", "ml", f"{func}-config")]["data"]["train_func.py"]
    assert "def greet(times):" in shipped and shipped.rstrip().endswith("_run(greet, {'times': 1})")

    assert sorted(j.name for j in client.list_jobs()) == sorted([name, func])
    assert client.get_job(name).state == JobState.CREATED
    server.add_pod("ml", name, 0, "Running", log="step 1 loss 5.5\nstep 2 loss 4.8\n")
    assert client.get_job(name).state == JobState.RUNNING
    assert list(client.get_job_logs(name, rank=0)) == ["step 1 loss 5.5", "step 2 loss 4.8"]
    server.set_conditions("ml", name, Complete="True")
    server.objects[("trainjobs", "ml", name)]["status"]["trainerStatus"] = {
        "progressPercentage": 100,
        "metrics": [{"name": "loss", "value": "4.8"}, {"name": "eval_loss", "value": "4.9"}],
    }
    info = client.wait_for_job_status(name, timeout=10, polling_interval=0.05)
    assert (info.state, info.loss, info.eval_loss) == (JobState.COMPLETE, 4.8, 4.9)
    with pytest.raises(LauncherError, match=f"job {name}: its metrics are in its run directory, which this "
                       "machine does not see .on Kubernetes: local_run_root="):
        client.get_job_metrics(name)
    shared = tmp_path / "shared"
    os.makedirs(shared / name)
    (shared / name / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 4.8}\n')
    metrics = cli("--launcher", "kubernetes", "--namespace", "ml", "--kubeconfig", kubeconfig,
                  "--local-run-root", str(shared), "metrics", name)
    assert metrics.returncode == 0, metrics.stderr
    assert [json.loads(line) for line in metrics.stdout.splitlines()] == [{"step": 1, "loss": 5.5},
                                                                         {"step": 2, "loss": 4.8}]
    assert info.end_time.isoformat() == "2026-11-29T00:00:00+00:00"

    got = cli("--launcher", "kubernetes", "--namespace", "ml", "--kubeconfig", kubeconfig, "get", name, "--json")
    assert got.returncode == 0 and json.loads(got.stdout)["state"] == "Complete", got.stderr
    client.delete_job(name)
    assert ("trainjobs", "ml", name) not in server.objects
    assert ("configmaps", "ml", f"{name}-config") not in server.objects  # garbage-collected with its owner
    missing = cli("--launcher", "kubernetes", "--namespace", "ml", "--kubeconfig", kubeconfig, "get", name)
    assert missing.returncode == 1 and f"cannot get TrainJob '{name}' in namespace 'ml': not found" in missing.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_in_the_drivers_own_process_is_on_record_too(home, tmp_path):
    from launchers.base import run_name

    run_dir = tmp_path / "in-process"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            *TINY,
            "train.max_steps=2",
            "train.eval_every=2",
            "train.eval_batches=1",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr
    got = cli("get", run_name(str(run_dir)), "--json")
    info = json.loads(got.stdout)
    assert (info["state"], info["step"], info["run_dir"]) == ("Complete", 2, str(run_dir)), got.stderr
    assert info["eval_loss"] == read_summary(str(run_dir))["final_eval_loss"]
    metrics = cli("metrics", run_name(str(run_dir)))
    with open(run_dir / "metrics.jsonl") as f:
        assert [json.loads(line) for line in metrics.stdout.splitlines()] == [json.loads(line) for line in f]


LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_characters="$", blacklist_categories=("Cs",)), max_size=12)
)
OPTION_VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.mark.timeout(120)
@settings(max_examples=examples(300))
@given(OPTION_VALUES)
def test_client_options_reach_the_trainer_as_the_same_values(value):
    """Client("kubernetes", env={...}, tolerations=[...], ...) turns each option into a Hydra override;
    Hydra's own parser must read back exactly the value given (quotes, backslashes, nesting and all)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from launchers.backend import hydra_value as _hydra

    parsed = OverridesParser.create().parse_override(f"++launcher.option={_hydra(value)}").value()
    assert parsed == value and type(parsed) is type(value)


def test_a_function_that_raises_ends_its_rank_in_one_line_and_the_users_frames(tmp_path):
    import importlib.util

    from launchers.functions import function_script

    (tmp_path / "user_code.py").write_text(textwrap.dedent("""\
        def fails(path):
            import json  # the job runs the function's source alone, as Kubeflow's CustomTrainer does

            def read(text):
                return json.loads(text)
            read("{not json at " + path)
        """))
    spec = importlib.util.spec_from_file_location("user_code", tmp_path / "user_code.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    script = tmp_path / "job" / "train_func.py"
    script.parent.mkdir()
    script.write_text(function_script(module.fails, {"path": "/data"}))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RANK": "1"})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "error: fails raised JSONDecodeError: Expecting property name enclosed in double quotes: " \
                       "line 1 column 2 (char 1) on rank 1", lines
    assert lines[1] == "Traceback (your code, most recent call last):"
    files = [line.split('"')[1] for line in lines[2:] if line.startswith("  File ")]
    assert files == [str(script)] * 2, lines  # fails, then read: not json's frames, not the call in the script
    assert (tmp_path / "job" / "logs" / "rank-1.log").read_text().strip() == proc.stderr.strip()
