"""`data.packing` under each strategy, for every recipe whose rows vary in length: recipe=sft, dpo, reward and kd
(padding_free and longest against max_length) and grpo and rloo (data=prompts pads to the longest row at
most: padding_free against longest) run as two gloo ranks under torchrun with strategy=ddp, fsdp2 and tp, the
model native and through transformers (model.impl=transformers), and every packing gives the same loss at every
step: the same rows in the same order, whatever carries padding."""

from __future__ import annotations

import pytest

from tests.conftest import DIST, read_metrics
from tests.trainer.recipes.test_dpo import preference_setup  # noqa: F401 (a fixture)
from tests.trainer.recipes.test_grpo import REWARDS_ON_PATH, TOY, prompts  # noqa: F401 (a fixture)
from tests.trainer.recipes.test_kd import models  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(600)

COMMON = ["train.progress=false", "train.log_every=1", "lr_schedule.warmup_steps=0", "train.max_steps=2",
          "train.eval_every=2", "train.grad_accum_steps=2"]
GROUP = ["recipe.num_generations=4", "train.global_batch_size=8", "data.seq_len=16", "recipe.max_completion_length=8",
         "recipe.beta=0.04", "optim.lr=1e-2", f"recipe.reward_funcs=[{TOY}]"]


def _run(request, recipe: str) -> tuple[list[str], tuple[str, ...]]:
    """The arguments of a `recipe` run on its tiny model and data, and its packings, the padded one first."""
    every = ("max_length", "longest", "padding_free")
    if recipe in ("sft", "kd"):
        student, teacher, chats = request.getfixturevalue("models")
        teach = [f"recipe.teacher.path={teacher}", "recipe.kd.chunk_tokens=16"] if recipe == "kd" else []
        return (["model=hf", f"model.path={student}", f"recipe={recipe}", *teach, "data=chat", f"data.path={chats}",
                 "data.seq_len=48", "data.eval_percent=40", "train.global_batch_size=8", "optim.lr=1e-2"], every)
    model, pairs = request.getfixturevalue("preference_setup")
    if recipe in ("dpo", "reward"):
        return (["model=hf", f"model.path={model}", f"recipe={recipe}", "data=preference", f"data.path={pairs}",
                 "data.seq_len=40", "data.eval_percent=20", "train.global_batch_size=8", "optim.lr=3e-3"], every)
    return (["model=hf", f"model.path={model}", f"recipe={recipe}", "data=prompts",
             f"data.path={request.getfixturevalue('prompts')}", "data.eval_percent=20", *GROUP],
            ("longest", "padding_free"))


# recipe=reward is refused before it starts under strategy=tp (its one-output score head cannot be split) and
# with model.impl=transformers (the score head sits on the native decoder).
# CI's e2e step runs a covering share (each recipe under two strategies, each strategy four times, each model.impl
# of a recipe that takes both once): a case is two or three torchrun runs, about a minute here. The rest of the
# grid is marked `matrix` (by hand: pytest -m matrix).
COVERING = {("sft", "tp", "native"), ("sft", "fsdp2", "transformers"), ("dpo", "ddp", "native"),
            ("dpo", "tp", "transformers"), ("reward", "ddp", "native"), ("reward", "fsdp2", "native"),
            ("grpo", "tp", "native"), ("grpo", "fsdp2", "transformers"), ("rloo", "ddp", "native"),
            ("rloo", "tp", "transformers"), ("kd", "fsdp2", "native"), ("kd", "ddp", "transformers")}
CASES = [pytest.param(recipe, strategy, impl,
                      marks=pytest.mark.e2e if (recipe, strategy, impl) in COVERING else pytest.mark.matrix)
         for recipe in ("sft", "dpo", "reward", "grpo", "rloo", "kd")
         for strategy in ("ddp", "fsdp2", "tp") for impl in ("native", "transformers")
         if recipe != "reward" or (strategy != "tp" and impl == "native")]


@pytest.mark.parametrize("recipe,strategy,impl", CASES)
def test_every_packing_gives_the_padded_runs_losses_under_each_strategy(recipe, strategy, impl, request, run_cli,
                                                                        tmp_path):
    args, ways = _run(request, recipe)
    losses = {}
    for way in ways:
        run = tmp_path / way
        proc = run_cli(*args, *COMMON, *DIST, f"strategy={strategy}", f"model.impl={impl}", f"data.packing={way}",
                       f"hydra.run.dir={run}", env=REWARDS_ON_PATH)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[way] = [m["loss"] for m in read_metrics(str(run))]
    padded = losses[ways[0]]
    assert len(padded) == 2
    for way in ways[1:]:
        assert losses[way] == pytest.approx(padded, abs=1e-5), way
