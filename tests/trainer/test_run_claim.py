"""A run directory belongs to one driver at a time, and what a run finished or set is kept: the directory is
claimed (an flock released by the holder's death) after the checks and before anything is written; a
second driver, a rerun of a finished run, a resume with another seed or sequence length change nothing;
a damaged newest checkpoint is passed over with a log line; a full disk says so and leaves no partial
checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, TINY, examples
from trainer.checkpoint.checks import damage
from trainer.checkpoint.manifest import MANIFEST
from trainer.errors import ConfigError
from trainer.prepare.run_dir import claim, note_before_making, remove_if_new
from trainjob.run_files import RunDir

HOLD = ("import sys, time; from trainer.prepare.run_dir import claim; claim(sys.argv[1]); print('held', flush=True); "
        "time.sleep(600)")


@pytest.fixture
def holder(tmp_path):
    """A process of its own that claims a run directory and holds it until it is killed."""
    procs = []

    def start(run_dir) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": REPO})
        assert proc.stdout.readline() == "held\n"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_claimed_directory_is_refused_until_its_holder_dies(tmp_path, holder):
    run_dir = str(tmp_path / "run")
    proc = holder(run_dir)
    with pytest.raises(ConfigError, match=rf"still running in this directory \(started by pid {proc.pid}"):
        claim(run_dir)
    proc.send_signal(signal.SIGKILL)  # no clean-up of its own: the kernel drops the lock
    proc.wait()
    claimed = claim(run_dir)
    with open(RunDir.of(run_dir).lock) as f:
        assert f.read().strip() == str(os.getpid())
    claimed.release()
    assert os.listdir(run_dir) == []  # the lock file goes; the directory, which the holder made, stays
    fresh = claim(str(tmp_path / "fresh" / "run"))
    fresh.release()
    assert os.listdir(tmp_path) == ["run"]  # what this process made for its claim goes with it


@settings(max_examples=examples(25))
@given(existing=st.integers(0, 3), new=st.integers(1, 3), other_file=st.booleans())
def test_a_refused_run_removes_exactly_the_folders_made_for_it(tmp_path_factory, existing, new, other_file):
    root = tmp_path_factory.mktemp("made")
    before = root.joinpath(*[f"e{i}" for i in range(existing)])
    before.mkdir(parents=True, exist_ok=True)
    run_dir = before.joinpath(*[f"n{i}" for i in range(new)])
    note_before_making(str(run_dir))
    run_dir.mkdir(parents=True)  # what Hydra does before the task starts
    if other_file:  # something else appeared meanwhile in a folder made for the run: it stays
        (run_dir.parent / "theirs.txt").write_text("x")
    remove_if_new(str(run_dir))
    assert before.is_dir()
    assert not run_dir.exists()
    assert (run_dir.parent / "theirs.txt").exists() == other_file
    if not other_file:
        assert not any(before.iterdir())


STEPS = [*TINY, "train.max_steps=2", "train.checkpoint_every=1", "train.keep_latest_k=2", "train.eval_batches=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """A finished two-step run with a checkpoint at each step."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    proc = subprocess.run([sys.executable, "-m", "trainer", *STEPS, f"hydra.run.dir={run_dir}"], cwd=REPO,
                          env={**os.environ, "TRAINJOB_CACHE": cache_dir}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _files(run_dir) -> dict[str, bytes]:
    """What the run wrote (not its logs, nor the lock file, which holds whoever holds the directory)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()
            and "logs" not in p.parts and p.name != ".lock"}


@pytest.mark.e2e
def test_nothing_of_a_run_changes_under_a_second_driver_a_rerun_or_another_seed(trained, run_cli_batch, holder,
                                                                              tmp_path):
    """And a copy of the run whose newest checkpoint is damaged goes on from the one before, saying so."""
    before = _files(trained)
    proc = holder(trained)
    second, = run_cli_batch([([*STEPS, f"hydra.run.dir={trained}", "optim.lr=0.01"], tmp_path)])
    assert second.returncode == 2, second.stderr
    assert "an earlier attempt of this run is still running" in second.stderr.strip().splitlines()[-1]
    proc.kill()
    proc.wait()
    assert _files(trained) == before  # config.yaml not replaced, no config.1.yaml

    damaged = tmp_path / "damaged"
    shutil.copytree(trained, damaged)
    newest = damaged / "checkpoints" / "step-2"
    shard = next(newest.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 3)
    cut_size = shard.stat().st_size
    rerun, seed, fallback = run_cli_batch([
        ([*STEPS, f"hydra.run.dir={trained}"], tmp_path),
        ([*STEPS, f"hydra.run.dir={trained}", "train.max_steps=3", "train.seed=5"], tmp_path),
        ([*STEPS, f"hydra.run.dir={damaged}", "train.max_steps=3"], tmp_path)])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "already trained to step 2" in rerun.stdout + rerun.stderr
    assert seed.returncode == 2, seed.stderr[-2000:]
    line = seed.stderr.strip().splitlines()[-1]
    assert line.startswith("error: invalid config: train.seed=5: the checkpoint ") and "keep train.seed=0" in line
    assert _files(trained) == before  # summary.json not rewritten by the rerun

    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert (f"checkpoint {newest} is damaged (its file {shard.name} is {cut_size} bytes, "
            in fallback.stdout + fallback.stderr)
    assert [p.name for p in (damaged / "checkpoints").glob("damaged-*/*")] == ["step-2"]  # set aside, kept
    assert '"resumed_from": "' + str(damaged / "checkpoints" / "step-1") in (damaged / "summary.json").read_text()
    # Export refuses a cut checkpoint by name and writes nothing; a non-QAT one quantises post-training.
    cut_run = tmp_path / "cut-run"
    shutil.copytree(trained, cut_run, ignore=shutil.ignore_patterns(".lock"))
    cut_shard = next((cut_run / "checkpoints" / "step-2").glob("*.distcp"))
    with open(cut_shard, "r+b") as f:
        f.truncate(cut_shard.stat().st_size - 1)
    cut, ptq = run_cli_batch([([str(cut_run / "checkpoints" / "step-2"), str(tmp_path / "cut-export")], tmp_path),
                              ([str(cut_run / "checkpoints" / "step-1"), str(tmp_path / "ptq"), "--quantize"],
                               tmp_path)], module="trainer.export")
    assert cut.returncode == 2 and len(cut.stderr.strip().splitlines()) == 1, cut.stderr
    assert f"cannot be loaded: its file {cut_shard.name} is {cut_shard.stat().st_size} bytes, " in cut.stderr
    assert not (tmp_path / "cut-export").exists() and not list(tmp_path.glob(".cut-export*"))
    assert ptq.returncode == 0, ptq.stderr[-2000:]
    assert {"quantized.pt", "quantization.json", "model.safetensors"} <= set(os.listdir(tmp_path / "ptq"))


@settings(max_examples=examples(10), deadline=None)
@given(cut=st.floats(0, 0.999), garbage=st.binary(min_size=0, max_size=64))
def test_any_truncated_shard_or_garbage_metadata_is_found_before_loading(trained, tmp_path_factory, cut, garbage):
    """By the checkpoint's manifest; and, without one (a checkpoint written before them), by DCP's metadata."""
    copy = tmp_path_factory.mktemp("damaged") / "step-2"
    shutil.copytree(trained / "checkpoints" / "step-2", copy)
    assert damage(str(copy)) is None
    shard = next(copy.glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(int(size * cut))
    assert damage(str(copy)) == f"its file {shard.name} is {int(size * cut)} bytes, {size} were written"
    (copy / ".metadata").write_bytes(garbage)
    assert damage(str(copy)).startswith("its file .metadata is ")
    os.remove(copy / MANIFEST)
    assert damage(str(copy)).startswith("its .metadata cannot be read")
    shutil.copy(trained / "checkpoints" / "step-2" / ".metadata", copy / ".metadata")
    assert "is truncated" in damage(str(copy))


@pytest.mark.e2e
def test_a_full_disk_while_checkpointing_says_so_and_leaves_no_partial_checkpoint(run_cli, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("a small tmpfs cannot be mounted here (needs root with CAP_SYS_ADMIN)")
    try:
        proc = run_cli(*STEPS, "train.max_steps=1", f"hydra.run.dir={disk / 'run'}", timeout=300)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("error: no space left on device for checkpoint "), line
        leftovers = [p.name for p in disk.rglob("*") if p.name.endswith((".partial", ".tmp"))]
        assert leftovers == []
        assert shutil.disk_usage(disk).free > 1 << 20  # the partial checkpoint no longer fills it
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(disk)], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)


NODE = ("import sys, time; from trainer.prepare.run_dir import claim; c = claim(sys.argv[1], nodes=2); "
        "print('node', c.node, flush=True); time.sleep(600)")


def test_the_nodes_of_a_multi_node_run_each_take_a_slot_and_a_single_driver_is_refused_meanwhile(tmp_path):
    """A local multi-node run is the same command once per node: each takes a free node slot of the run
    directory; a node beyond runtime.nnodes, and a single-node driver, are refused; a lost node's slot is
    free for the next node to start."""
    run_dir = str(tmp_path / "run")
    nodes = []
    try:
        for expected in (0, 1):
            proc = subprocess.Popen([sys.executable, "-c", NODE, run_dir], cwd=REPO, stdout=subprocess.PIPE,
                                    text=True, env={**os.environ, "PYTHONPATH": REPO})
            nodes.append(proc)
            assert proc.stdout.readline() == f"node {expected}\n"
        with pytest.raises(ConfigError, match=r"runtime.nnodes=2: all 2 nodes of the run in .* are running already"):
            claim(run_dir, nodes=2)
        with pytest.raises(ConfigError, match="still running in this directory"):
            claim(run_dir)
        nodes[0].kill()
        nodes[0].wait()
        again = claim(run_dir, nodes=2)
        assert (again.node, again.others) == (0, True)
        again.release()
        assert os.path.exists(RunDir(run_dir).lock)  # the run's lock stays with its other node
    finally:
        for proc in nodes:
            proc.kill()
            proc.wait()
