"""Context parallelism (strategy.cp): the load-balanced split of a row and its inverse; cp=2 on two gloo ranks (and
fsdp2 x cp, tp x cp on four) ends at one process's losses, for the native model's pretraining and for Hugging Face
families fine-tuned with SFT on packed conversations (documents never attending across their boundary; soft-capped
and sliding-window attention, a mixture's router loss); a cp=2 checkpoint resumes under cp=1 on the uninterrupted
curve; what cp does not compose with is refused in one line before any work."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.conftest import DIST, REFERENCE, TINY, compose_refused, read_metrics, read_summary
from tests.trainer.hf_models import SAMPLE, add_tokenizer, make_llama, make_named, make_qwen2
from tests.trainer.parallel.test_strategies import resumes_in_one_process
from tests.trainer.recipes.test_dpo import ARGS as DPO_ARGS
from tests.trainer.recipes.test_grpo import ARGS as GRPO_ARGS
from tests.trainer.recipes.test_grpo import REWARDS_ON_PATH, TOY
from tests.trainer.recipes.test_kd import ARGS as KD_ARGS
from tests.trainer.recipes.test_sft import _chats
from trainer.parallel.context import ContextParallel, GatheredCausalChunks, held_chunks, spans, split, unsplit

# Every rank computes the same sums in other orders (attention chunk by chunk over gathered keys, losses summed
# per rank): float32 rounding only, ~1e-7 measured; a wrong chunk, position or mask moves the loss by > 1e-2.
RTOL = 1e-5
CP = ["strategy=fsdp2_cp"]
FOUR = ["+runtime=torch-distributed", "runtime.nproc_per_node=4"]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_load_balanced_split_gives_each_rank_its_head_and_tail_and_unsplits_to_the_row(cp):
    row = torch.arange(2 * cp * 3).reshape(1, -1).repeat(2, 1)
    parts = [split(row, cp, rank) for rank in range(cp)]
    for rank, part in enumerate(parts):
        head, tail = held_chunks(cp, rank)
        assert (head, tail) == (rank, 2 * cp - 1 - rank)
        assert part[0].tolist() == [*range(3 * head, 3 * head + 3), *range(3 * tail, 3 * tail + 3)]
    # Every rank attends over as many keys: the ends of its two chunks add up the same.
    assert len({sum(3 * (c + 1) for c in held_chunks(cp, rank)) for rank in range(cp)}) == 1
    assert torch.equal(unsplit(torch.cat(parts, dim=1), cp), row)
    assert torch.equal(unsplit(torch.cat([p.T for p in parts], dim=0), cp, dim=0), row.T)


def _chunks_rank(rank: int, cp: int, store: str, case: tuple, scale, out: str) -> None:
    """One cp rank of the test below: its share of the queries, keys, values and upstream gradient through
    `GatheredCausalChunks`; its output and gradients to `out`.<rank>."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cp)
    q, k, v, weights = (split(x, cp, rank, dim=2).clone() for x in case)
    q, kv = q.requires_grad_(), torch.stack((k, v)).requires_grad_()
    attention = GatheredCausalChunks.apply(q, kv, ContextParallel(init_device_mesh("cpu", (cp,))),
                                           spans(q.shape[2] * cp, cp, rank), scale)
    torch.save((attention.detach(), *torch.autograd.grad((attention * weights).sum(), (q, kv))), f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize(("cp", "heads", "kv_heads", "scale", "dtype"), [
    (2, 4, 2, None, torch.float32), (4, 2, 2, 0.3, torch.float64), (3, 4, 1, None, torch.float32)])
def test_mask_free_chunks_of_every_rank_are_the_whole_rows_causal_attention(tmp_path, cp, heads, kv_heads, scale,
                                                                             dtype):
    """cp gloo ranks, each attending with its two chunks of queries over the keys and values all-gathered from
    every rank's share, without a mask (`GatheredCausalChunks`, which gathers them again in its backward and
    reduce-scatters their gradients): the outputs put back in row order, and the q/k/v gradients of each rank's
    share, are one causal scaled_dot_product_attention's over the whole row (grouped-query too)."""
    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(cp)
    seq, dim = 2 * cp * 5, 8
    q, k, v = (torch.randn(2, h, seq, dim, generator=gen, dtype=dtype, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    weights = torch.randn(2, heads, seq, dim, generator=gen, dtype=dtype)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                 enable_gqa=heads != kv_heads)
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    out = str(tmp_path / "out")
    case = tuple(x.detach() for x in (q, k, v, weights))
    mp.start_processes(_chunks_rank, args=(cp, str(tmp_path / "store"), case, scale, out), nprocs=cp, join=True,
                       start_method="fork")
    ranks = [torch.load(f"{out}.{rank}") for rank in range(cp)]
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(unsplit(torch.cat([r[0] for r in ranks], dim=2), cp, dim=2), reference, **tol)
    for rank, (_, dq, dkv) in enumerate(ranks):
        for name, grad, want in zip("qkv", (dq, *dkv.unbind(0)), expected, strict=True):
            torch.testing.assert_close(grad, split(want, cp, rank, dim=2), **tol,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank} d{name}: {m}")


@pytest.mark.parametrize(("overrides", "message"), [
    ([*DIST, *CP, "data.seq_len=30"], "data.seq_len=30: must be divisible by 2 x strategy.cp = 4 (context "
     "parallelism cuts each row into 2 x cp chunks)"),
    ([*FOUR, *CP, "strategy.pp=2", "strategy.dp_shard=1"], "strategy.cp=2: context parallelism does not compose "
     "with pipeline parallelism (strategy.pp=2)"),
    ([*DIST, "strategy=ddp", "strategy.cp=2", "strategy.dp_replicate=1"], "strategy.cp=2: strategy=ddp uses only "
     "strategy.dp_replicate; this must be 1"),
    ([*DIST, *CP, "recipe=ppo", "data=prompts", "data.path=/tmp/p.jsonl",
      "recipe.reward_funcs=[trainer.rewards.shipped:contains_answer]"], "recipe='ppo': strategy.cp=2 runs pretrain, "
     "sft, dpo, kd, grpo, rloo; recipe=ppo does not compose with context parallelism"),
    ([*FOUR, *CP, "strategy.dp_shard=1", "strategy.tp=2", "recipe=grpo", "data=prompts", "data.path=/tmp/p.jsonl",
      "recipe.reward_funcs=[trainer.rewards.shipped:contains_answer]"], "strategy.tp=2: recipe=grpo under "
     "strategy.cp=2 reads log-probabilities over whole rows, which tensor parallelism's sequence split does not give"),
    ([*CP], "strategy='fsdp2_cp': strategy=fsdp2_cp needs more than one process"),
])
def test_what_cannot_run_under_cp_is_refused_in_one_line(tmp_path, capsys, overrides, message):
    err = compose_refused(tmp_path, capsys, *TINY, *overrides)
    assert message in err and len(err.strip().splitlines()) == 1, err


def _same_curve(run_dir, ref_dir, steps: int, near_zero: float = 0.0) -> None:
    """`near_zero`: an absolute tolerance besides RTOL, for a loss that falls to nearly 0 (dpo's)."""
    metrics, ref = read_metrics(str(run_dir)), read_metrics(str(ref_dir))
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in ref], rel=RTOL, abs=near_zero)
    assert [m["grad_norm"] for m in metrics] == pytest.approx([m["grad_norm"] for m in ref], rel=1e-4)
    final = read_summary(str(run_dir))["final_eval_loss"]
    assert final == pytest.approx(read_summary(str(ref_dir))["final_eval_loss"], rel=RTOL, abs=near_zero)


VARIANTS = {
    "cp2": [*DIST, *CP],
    "fsdp2xcp-4-ranks": [*FOUR, *CP, "strategy.dp_shard=2"],
    "tpxcp-4-ranks": [*FOUR, *CP, "strategy.dp_shard=1", "strategy.tp=2"],
}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("variant", [v if v == "cp2" else pytest.param(v, marks=pytest.mark.extended)
                                     for v in VARIANTS])
def test_cp_pretraining_reproduces_the_single_process_loss_curve(run_cli, tmp_path, single_reference, variant):
    run_dir = tmp_path / variant
    proc = run_cli(*REFERENCE, *VARIANTS[variant], f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(str(run_dir))
    assert summary["world_size"] == (2 if variant == "cp2" else 4)
    _same_curve(run_dir, single_reference, 6)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_cp2_checkpoint_resumes_under_cp1_on_the_uninterrupted_curve(run_cli, tmp_path):
    resumes_in_one_process(run_cli, tmp_path, [*DIST, *CP], rtol=RTOL)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(("family", "packing"), [("gemma2", "padding_free"),
                                               pytest.param("qwen3_moe", "max_length", marks=pytest.mark.extended)])
def test_cp_sft_on_chats_of_a_hugging_face_family_equals_one_process(run_cli, tmp_path_factory, family, packing):
    """gemma2: soft-capped attention and final logits, sliding-window layers, on packed rows (padding_free: one
    packed row a micro-batch, its documents split with it); qwen3_moe: experts and the router's load-balancing
    loss (over the whole rows' routing), on padded rows: under padding_free the few pad tokens that round a packed
    row to a multiple of 2 x cp would take part in the router's statistics, which one process's row lacks."""
    root = tmp_path_factory.mktemp(f"cp-{family}")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _chats(24, seed=3)))
    args = ["model=hf", f"model.path={make_named(str(root), family)}", "recipe=sft", "data=chat",
            f"data.path={chats}", "data.seq_len=48", "data.eval_percent=25", "train.global_batch_size=4",
            "train.max_steps=6", "train.eval_every=6", "train.progress=false", "train.log_every=1",
            "lr_schedule.warmup_steps=1", f"data.packing={packing}"]
    runs = {}
    for name, extra in (("single", []), ("cp2", [*DIST, *CP])):
        runs[name] = root / name
        proc = run_cli(*args, *extra, f"hydra.run.dir={runs[name]}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(runs["cp2"], runs["single"], 6)


@pytest.mark.slow
@pytest.mark.e2e
def test_cp_dpo_equals_one_process(run_cli, tmp_path_factory):
    """recipe=dpo reads its log-probabilities over whole rows (the final hidden states gathered back into row
    order), the frozen reference under cp too."""
    root = tmp_path_factory.mktemp("cp-dpo")
    rng = random.Random(0)
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": rng.choice(SAMPLE)[:30], "chosen": "I am fine, thank you.",
                                         "rejected": "def main(): return 42"}) + "\n" for _ in range(40)))
    args = [*DPO_ARGS, "model=hf", f"model.path={make_named(str(root), 'llama')}", f"data.path={pairs}",
            "train.max_steps=6", "train.eval_every=6"]
    runs = {}
    for name, extra in (("single", []), ("cp2", [*DIST, *CP])):
        runs[name] = root / name
        proc = run_cli(*args, *extra, f"hydra.run.dir={runs[name]}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    # The pairs are soon told apart: the loss falls from log 2 to ~5e-3, where float32's rounding is ~1e-5 of it.
    _same_curve(runs["cp2"], runs["single"], 6, near_zero=1e-6)


def _single_and_cp2(run_cli, root, args: list[str], env: dict | None = None) -> dict:
    """The run directories of `args` in one process and under cp=2 on two gloo ranks."""
    runs = {}
    for name, extra in (("single", []), ("cp2", [*DIST, *CP])):
        runs[name] = root / name
        proc = run_cli(*args, *extra, f"hydra.run.dir={runs[name]}", env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return runs


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("recipe", ["grpo", "rloo"])
def test_cp_grpo_and_rloo_equal_one_process(run_cli, tmp_path_factory, recipe):
    """grpo and rloo sample with the key-value cache (whole rows on each cp rank, the same completions: their
    generators are seeded by the data-parallel rank) and read the policy's, the sampling policy's and the
    reference's log-probabilities over whole rows padded to a multiple of 2 x cp; the batch-wide scaling of the
    rewards takes one of the cp peers' rewards. Two updates per generation batch, so that the ratio moves."""
    root = tmp_path_factory.mktemp(f"cp-{recipe}")
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far"]
    prompts.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(2, 4)))})
                               + "\n" for _ in range(40)))
    scaled = "recipe.scale_rewards=batch" if recipe == "grpo" else "recipe.normalize_advantages=true"
    args = [*GRPO_ARGS, f"recipe={recipe}", f"data.path={prompts}", f"recipe.reward_funcs=[{TOY}]", scaled,
            "recipe.num_iterations=2", "train.max_steps=4", "train.eval_every=4"]
    runs = _single_and_cp2(run_cli, root, args, REWARDS_ON_PATH)
    single, cp2 = read_metrics(str(runs["single"])), read_metrics(str(runs["cp2"]))
    assert [m["reward"] for m in cp2] == [m["reward"] for m in single]  # the same completions
    assert [m["kl"] for m in cp2] == pytest.approx([m["kl"] for m in single], rel=RTOL, abs=1e-7)
    assert cp2[1]["clip_ratio/region_mean"] == pytest.approx(single[1]["clip_ratio/region_mean"], abs=1e-6)
    # The loss is a mean of advantage-weighted ratios of order 1 that cancel to a few hundredths, so the terms'
    # float32 rounding shows as an absolute error of their size, not the loss's: rloo's fourth loss, -0.0776, came
    # out 7.9e-7 off (1.02e-5 relative) on an AMD EPYC of this machine kind, where 1e-5 relative and 1e-7 absolute
    # failed it; a wrong chunk, position or mask moves it by > 1e-2.
    _same_curve(runs["cp2"], runs["single"], 4, near_zero=2e-6)


@pytest.mark.slow
@pytest.mark.e2e
def test_cp_kd_equals_one_process(run_cli, tmp_path_factory):
    """recipe=kd under cp: the teacher's final hidden states and the student's gathered back into row order, the
    divergence over whole rows on every cp rank."""
    root = tmp_path_factory.mktemp("cp-kd")
    student, teacher = add_tokenizer(make_llama(str(root))), add_tokenizer(make_qwen2(str(root)))
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _chats(24, seed=5)))
    args = ["model=hf", f"model.path={student}", f"recipe.teacher.path={teacher}", f"data.path={chats}", *KD_ARGS,
            "train.max_steps=4", "train.eval_every=4"]
    runs = _single_and_cp2(run_cli, root, args)
    single, cp2 = read_metrics(str(runs["single"])), read_metrics(str(runs["cp2"]))
    assert [m["kd/divergence"] for m in cp2] == pytest.approx([m["kd/divergence"] for m in single], rel=RTOL)
    _same_curve(runs["cp2"], runs["single"], 4)
