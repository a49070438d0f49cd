"""Pipeline parallelism (`strategy.pp`) trains to the one-process losses under each schedule, alone and with
fsdp2 or tp; its checkpoints resume under other strategies and theirs under it; asynchronous checkpoints
(`train.checkpoint_async`) change no bit of training; what cannot run is refused in one line.

One torchrun start per world size trains all of its runs (tests/trainer/strategy_ranks.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import DIST, REPO, TINY, cli, compose_refused, compose_run, read_metrics, read_summary
from tests.trainer.hf_models import add_tokenizer, make_llama
from tests.trainer.recipes.test_sft import ARGS as SFT_ARGS
from tests.trainer.recipes.test_sft import _chats

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # pipelines on 2 and 4 ranks, each against one process

PP = ["strategy=pp"]
# The bar: 20 steps, each loss within 1e-6 of one process's. Four blocks, so that interleaved_1f1b
# runs four stages on two ranks. Gradient norms drift further in float32 whatever the strategy (plain fsdp2
# and tp reach 3e-6 by step 15 here, from the order of their reductions), so they are held to 1e-5.
LONG = [*TINY, "model.n_layers=4", "train.max_steps=20", "train.eval_every=10"]
LOSS_RTOL, GRAD_NORM_RTOL = 1e-6, 1e-5
FOUR = ["+runtime=torch-distributed", "runtime.nproc_per_node=4"]
SCHEDULE = "strategy.pp_schedule="


def _launch(cache_dir: str, nproc: int, runs: dict[str, list[str]], root) -> dict[str, str]:
    """Prepare each run (the driver's checks, its config saved) and train them all in one torchrun start; the
    run directories by name."""
    dirs = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRAINJOB_CACHE", cache_dir)
        for name, overrides in runs.items():
            dirs[name] = compose_run(root / name, *overrides).spec.run_dir
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "tests.trainer.strategy_ranks", *(os.path.join(d, "config.yaml") for d in dirs.values())],
        cwd=REPO, env={**os.environ, "TRAINJOB_CACHE": cache_dir, "PYTHONPATH": REPO}, capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dirs


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> str:
    """LONG in one process, with checkpoints at steps 10 and 20."""
    run_dir = tmp_path_factory.mktemp("long") / "run"
    proc = cli(cache_dir, run_dir.parent, *LONG, "train.checkpoint_every=10", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(run_dir)


@pytest.fixture(scope="module")
def sft(tmp_path_factory, cache_dir) -> tuple[list[str], str]:
    """recipe=sft on chats of a Hugging Face Llama: its arguments, and its run in one process (padding_free)."""
    root = tmp_path_factory.mktemp("pp-sft")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _chats(48)))
    args = ["model=hf", f"model.path={add_tokenizer(make_llama(str(root)))}", *SFT_ARGS, f"data.path={chats}",
            "train.max_steps=4", "train.eval_every=2"]
    proc = cli(cache_dir, root, *args, f"hydra.run.dir={root / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return args, str(root / "run")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cache_dir, sft) -> dict[str, str]:
    every5 = [*LONG, *DIST, *PP, "strategy.pp_microbatches=4", "train.checkpoint_every=5"]
    return _launch(cache_dir, 2, {
        # one row per micro-batch: each counts its own assistant tokens; rows padded to data.seq_len under pp
        "sft": [*sft[0], *DIST, *PP, "strategy.pp_microbatches=4"],
        "gpipe": [*LONG, *DIST, *PP, SCHEDULE + "gpipe", "train.checkpoint_every=10"],
        "1f1b": every5,
        "1f1b-async": [*every5, "train.checkpoint_async=true"],
        "interleaved_1f1b": [*LONG, *DIST, *PP, SCHEDULE + "interleaved_1f1b"],
    }, tmp_path_factory.mktemp("two-ranks"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, cache_dir, two_ranks, reference) -> dict[str, str]:
    from_pp = f"train.resume={two_ranks['gpipe']}/checkpoints/step-10"
    return _launch(cache_dir, 4, {
        "pp-gpipe": [*LONG, *FOUR, *PP, SCHEDULE + "gpipe"],  # four stages, one per rank
        "pp-tp": [*LONG, *FOUR, "strategy=tp", "strategy.pp=2"],
        "pp-tp-interleaved_1f1b": [*LONG, *FOUR, "strategy=tp", "strategy.pp=2", SCHEDULE + "interleaved_1f1b"],
        "fsdp2_pp-interleaved_1f1b": [*LONG, *FOUR, "strategy=fsdp2_pp", SCHEDULE + "interleaved_1f1b"],
        "fsdp2_pp-from-single": [*LONG, *FOUR, "strategy=fsdp2_pp",
                                 f"train.resume={reference}/checkpoints/step-10"],
        "fsdp2-from-pp": [*LONG, *FOUR, "strategy=fsdp2", from_pp],
        "ddp-from-pp": [*LONG, *FOUR, "strategy=ddp", from_pp],
    }, tmp_path_factory.mktemp("four-ranks"))


def _same_curve(run_dir: str, reference: str) -> None:
    metrics, ref = read_metrics(run_dir), {m["step"]: m for m in read_metrics(reference)}
    assert metrics and [m["step"] for m in metrics] == sorted(ref)[-len(metrics):]
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)):
        assert [m[key] for m in metrics] == pytest.approx([ref[m["step"]][key] for m in metrics], rel=rtol)
    assert read_summary(run_dir)["final_eval_loss"] == pytest.approx(read_summary(reference)["final_eval_loss"],
                                                                     rel=LOSS_RTOL)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_each_schedule_on_two_ranks_gives_the_single_process_losses_over_20_steps(two_ranks, reference, name):
    _same_curve(two_ranks[name], reference)
    assert len(read_metrics(two_ranks[name])) == 20
    assert read_summary(two_ranks[name])["params"] == read_summary(reference)["params"]


def test_sft_on_packed_chats_gives_the_single_process_losses(two_ranks, sft):
    _same_curve(two_ranks["sft"], sft[1])


@pytest.mark.parametrize("name", ["pp-gpipe", "pp-tp", "pp-tp-interleaved_1f1b", "fsdp2_pp-interleaved_1f1b"])
def test_pp_alone_with_tp_and_with_fsdp2_on_four_ranks_give_the_single_process_losses(four_ranks, reference,
                                                                                     name):
    _same_curve(four_ranks[name], reference)
    assert len(read_metrics(four_ranks[name])) == 20


def test_fsdp2_pp_resumes_a_single_process_checkpoint_to_its_losses(four_ranks, reference):
    # a checkpoint of another strategy loads into the stages
    assert read_summary(four_ranks["fsdp2_pp-from-single"])["steps_this_run"] == 10
    _same_curve(four_ranks["fsdp2_pp-from-single"], reference)


@pytest.mark.parametrize("name", ["fsdp2-from-pp", "ddp-from-pp"])
def test_a_checkpoint_saved_under_pp_resumes_under_other_strategies(four_ranks, reference, name):
    summary = read_summary(four_ranks[name])
    assert summary["resumed_from"].endswith("gpipe/run/checkpoints/step-10") and summary["steps_this_run"] == 10
    _same_curve(four_ranks[name], reference)


def _tensors(path: str, tmp_path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / (os.path.basename(os.path.dirname(os.path.dirname(path))) + ".pt")
    dcp_to_torch_save(path, str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def test_asynchronous_checkpoints_change_no_bit_of_training_or_of_the_checkpoint(two_ranks, tmp_path):
    sync, background = two_ranks["1f1b"], two_ranks["1f1b-async"]
    assert read_metrics(background) and [(m["loss"], m["grad_norm"]) for m in read_metrics(background)] == [
        (m["loss"], m["grad_norm"]) for m in read_metrics(sync)]
    assert read_summary(background)["final_eval_loss"] == read_summary(sync)["final_eval_loss"]
    for run in (sync, background):  # keep_latest_k=2 of steps 5, 10, 15, 20; nothing partial left
        assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step-15", "step-20"]
    mine, theirs = (_tensors(os.path.join(r, "checkpoints", "step-15"), tmp_path) for r in (background, sync))
    assert mine.keys() == theirs.keys() and any(k.startswith(".optim.state.") for k in mine)
    for key, value in theirs.items():
        assert torch.equal(mine[key], value) if isinstance(value, torch.Tensor) else mine[key] == value, key


@pytest.mark.parametrize(("overrides", "message"), [
    ([*DIST, *PP, "model.n_layers=3"],
     "model.n_layers=3: must be divisible by the 2 pipeline stages (strategy.pp=2 x 1 per rank)"),
    ([*DIST, *PP, "strategy.pp_split_points=[4]"], "strategy.pp_split_points=[4]: must be 1 increasing block "
     "indices in 1..3"),
    ([*DIST, *PP, "strategy.pp_microbatches=1"], "strategy.pp_microbatches=1: strategy.pp_schedule=1f1b needs at "
     "least as many micro-batches as pipeline ranks (strategy.pp=2)"),
    ([*DIST, *PP, "strategy.pp_microbatches=3"], "strategy.pp_microbatches=3: must divide the local batch of 16 rows"),
    ([*DIST, *PP, "strategy.pp_schedule=interleaved_1f1b", "strategy.pp_stages_per_rank=1"],
     "strategy.pp_stages_per_rank=1: strategy.pp_schedule=interleaved_1f1b runs several stages per rank"),
    ([*DIST, *PP, "strategy.pp_schedule=zero_bubble"], "strategy.pp_schedule='zero_bubble': must be one of gpipe, "
     "1f1b, interleaved_1f1b"),
    ([*DIST, "strategy=ddp", "strategy.pp=2"], "strategy.pp=2: strategy=ddp (data_parallel=ddp) does not compose"),
    ([*DIST, *PP, "model.tie_embeddings=true"], "strategy.pp=2: model debug ties its output layer to the embedding"),
    ([*DIST, *PP, "recipe=grpo", "data=prompts", "data.path=/tmp/p.jsonl",
      "recipe.reward_funcs=[trainer.rewards.shipped:contains_answer]"], "recipe='grpo': strategy.pp=2 runs recipes"),
    ([*PP], "strategy='pp': strategy=pp needs more than one process"),
    ([*FOUR, *PP, "strategy.pp=2"], "= 2 must equal the world size 4 (or give one of them as -1 for the rest of "
     "the world, e.g. strategy.dp_shard=-1 to shard it with FSDP2)"),
])
def test_what_cannot_run_under_pp_is_refused_in_one_line(tmp_path, capsys, overrides, message):
    err = compose_refused(tmp_path, capsys, *overrides)
    assert message in err and len(err.strip().splitlines()) == 1, err
