"""`recipe=grpo` on `data=prompts`, end to end: a toy task is learnt on a tiny debug model in 30 steps (the mean
reward rises), every metrics line holds the reward of each function, KL, clip ratio and completion length, two
ranks under FSDP2 (real torchrun and gloo; generation collective) train with several updates per generation
batch, and what cannot run is refused in one line before anything runs. The loss itself is checked against TRL's
formula in test_grpo_loss.py."""

from __future__ import annotations

import json
import math
import os
import random

import pytest

from tests.conftest import REPO, TINY, compose_refused, compose_run, read_metrics, read_summary
from trainer.checkpoint.checks import damage
from trainer.config import ConfigError
from trainer.recipes import grpo
from trainer.rewards import functions as reward_funcs

pytestmark = pytest.mark.timeout(300)

TOY = "tests.trainer.grpo_rewards:lowercase"
REWARDS_ON_PATH = {"PYTHONPATH": REPO}  # where a user's reward module must be: importable by the ranks
ARGS = [*[a for a in TINY if not a.startswith(("data.seq_len", "train.global_batch_size"))], "recipe=grpo",
        "data=prompts", "data.seq_len=16", "data.eval_percent=20", "lr_schedule.warmup_steps=0", "optim.lr=1e-2",
        "recipe.num_generations=4", "train.global_batch_size=16", "recipe.max_completion_length=8",
        "recipe.beta=0.04"]  # a KL to the reference (TRL's default beta=0 holds none), so that `kl` is measured


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "sun", "sky"]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(3)),
                                        "target": rng.randint(2, 6)}) + "\n" for _ in range(64)))
    return str(path)


def test_the_mean_reward_rises_on_a_toy_task(prompts, run_cli, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*ARGS, f"data.path={prompts}", f"recipe.reward_funcs=[{TOY}]", "train.max_steps=30",
                   "train.eval_every=30", f"hydra.run.dir={run}", env=REWARDS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(run))
    assert len(lines) == 30
    for line in lines:
        for key in ("rewards/lowercase/mean", "rewards/lowercase/std", "reward", "reward_std", "kl",
                    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                    "completions/mean_length"):
            assert key in line, key
        assert 0 < line["completions/mean_length"] <= 8
    first = sum(m["reward"] for m in lines[:5]) / 5
    last = sum(m["reward"] for m in lines[-5:]) / 5
    assert first < 0.2 and last > first + 0.3, (first, last)
    assert lines[0]["kl"] == pytest.approx(0, abs=1e-6) and lines[-1]["kl"] > 0  # the reference is the start
    assert read_summary(str(run))["final_eval_loss"] == pytest.approx(-lines[-1]["reward"], abs=0.35)


@pytest.mark.e2e
def test_an_eval_split_short_of_a_steps_prompts_under_the_default_share_trains_without_eval(run_cli, tmp_path):
    """40 prompts at the default data.eval_percent: the eval split holds a row, fewer than the 2 prompts of a
    step, so the run trains without eval and says so once; an explicit share that does the same is refused."""
    rng = random.Random(0)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(["the", "cat", "sat", "on"]) for _ in range(4))})
                            + "\n" for _ in range(40)))
    args = [*[a for a in ARGS if not a.startswith(("data.eval_percent", "train.global_batch_size"))],
            f"data.path={path}", f"recipe.reward_funcs=[{TOY}]", "train.global_batch_size=8", "train.max_steps=2"]
    proc = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", env=REWARDS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "training without eval" in line]
    assert len(said) == 1 and "eval split of data=prompts 1 row(s), too few for an eval step (2)" in said[0], said
    assert [m.get("eval_loss") for m in read_metrics(str(tmp_path / "run"))] == [None, None]
    refused = run_cli(*args, "data.eval_percent=2", f"hydra.run.dir={tmp_path / 'explicit'}", env=REWARDS_ON_PATH)
    assert refused.returncode == 2 and "the eval split of data.path=" in refused.stderr, refused.stderr


@pytest.mark.e2e
def test_two_ranks_under_fsdp2_with_several_updates_per_generation_batch(prompts, run_cli, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*ARGS, f"data.path={prompts}", f"recipe.reward_funcs=[{TOY},tests.trainer.grpo_rewards:length]",
                   "recipe.reward_weights=[1.0,0.5]", "recipe.num_iterations=2", "recipe.scale_rewards=batch",
                   "train.max_steps=2", "train.eval_every=2", "train.grad_accum_steps=2", "strategy=fsdp2",
                   "+runtime=torch-distributed", "runtime.nproc_per_node=2", f"hydra.run.dir={run}",
                   env=REWARDS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(run))
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        weighted = m["rewards/lowercase/mean"] + 0.5 * m["rewards/length/mean"]
        assert m["reward"] == pytest.approx(weighted, rel=1e-5)
    # The second update of a generation batch reuses its completions: the same rewards, and a ratio that moved.
    assert lines[1]["reward"] == pytest.approx(lines[0]["reward"], rel=1e-6)
    assert lines[0]["clip_ratio/region_mean"] == 0 and lines[1]["clip_ratio/region_mean"] > 0


@pytest.mark.e2e
def test_a_reward_function_that_raises_ends_every_rank_in_one_report_of_the_users_frames(prompts, run_cli, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*ARGS, f"data.path={prompts}", "recipe.reward_funcs=[tests.trainer.grpo_rewards:server_down]",
                   "train.max_steps=5", "train.eval_every=100", "train.checkpoint_every=1",
                   "+runtime=torch-distributed", "runtime.nproc_per_node=2", f"hydra.run.dir={run}",
                   env=REWARDS_ON_PATH)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr[proc.stderr.index("error: reward function"):].splitlines()
    # Both ranks failed alike; the driver says it once: the line, then the user's frames and nothing else.
    assert proc.stderr.count("error: reward function") == 1
    assert err[0] == ("error: reward function tests.trainer.grpo_rewards:server_down raised ConnectionError: reward "
                      "server http://127.0.0.1:9/score is down (8 completions unscored) at step 3")
    assert err[1] == "Traceback (your code, most recent call last):"
    files = [line.split('"')[1] for line in err[2:] if line.startswith("  File ")]
    assert files == [os.path.join(REPO, "tests", "trainer", "grpo_rewards.py")] * 2, err
    assert "hydra" not in proc.stderr.lower().replace("hydra.run.dir", "")
    # The last whole checkpoint stays, to resume from once the server is back.
    assert sorted(os.listdir(run / "checkpoints")) == ["step-1", "step-2"]
    assert damage(str(run / "checkpoints" / "step-2")) is None


def test_grpo_runs_that_cannot_train_are_refused(prompts, tmp_path, capsys):
    base = [*ARGS, f"data.path={prompts}"]
    cases = {
        "recipe.reward_funcs=[tests.trainer.nowhere:f]": "recipe.reward_funcs='tests.trainer.nowhere:f': cannot be "
                                                         "imported: No module named 'tests.trainer.nowhere'",
        "recipe.reward_funcs=[tests.trainer.grpo_rewards:no_completions]": "must take the keyword arguments prompts "
                                                                           "and completions",
        "recipe.reward_funcs=[tests.trainer.grpo_rewards:needs_a_column]": "takes difficulty, which the rows of",
        f"recipe.reward_funcs=[{TOY}] recipe.num_generations=3": "recipe.num_generations=3: must divide "
                                                                 "train.global_batch_size=16",
        f"recipe.reward_funcs=[{TOY}] recipe.loss_type=sigmoid": "recipe.loss_type='sigmoid': must be one of grpo, "
                                                                 "bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo",
        f"recipe.reward_funcs=[{TOY}] recipe.importance_sampling_level=seq": "recipe.importance_sampling_level='seq'"
                                                                            ": must be one of token, sequence",
        f"recipe.reward_funcs=[{TOY}] data.packing=max_length": "data.packing='max_length': data=prompts pads a "
                                                                "prompt and its completion to the micro-batch's "
                                                                "longest row at most",
    }
    for overrides, message in cases.items():
        assert message in compose_refused(tmp_path, capsys, *base, *overrides.split()), overrides
    err = compose_refused(tmp_path, capsys, *base, f"recipe.reward_funcs=[{TOY}]", "+runtime=torch-distributed",
                          "runtime.nproc_per_node=8", "train.global_batch_size=16", "recipe.num_generations=4")
    assert "gives 4 prompts a step, which must be divisible by the data-parallel size 8" in err
    assert "recipe=grpo trains on data=prompts" in compose_refused(tmp_path, capsys, *TINY, "recipe=grpo")


# Each loss type's own settings off their defaults, and the importance-sampling level it must have.
LOSS_SETTINGS = {"cispo": ["recipe.epsilon_high=5.0"], "sapo": ["recipe.sapo_temperature_pos=0.8",
                                                              "recipe.sapo_temperature_neg=1.2"],
                 "luspo": ["recipe.importance_sampling_level=sequence", "recipe.delta=1.5"],
                 "vespo": ["recipe.vespo_k_pos=1.5", "recipe.vespo_lambda_neg=1.5"],
                 "dapo": ["recipe.epsilon_high=0.28", "recipe.delta=1.5"], "dr_grpo": ["recipe.epsilon=0.1"]}


@pytest.mark.slow  # a tiny run in a subprocess per loss type
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.e2e
def test_every_loss_type_trains(prompts, run_cli, tmp_path, loss_type):
    """Two steps on one generation batch (the second's ratio moved, so each loss type's weights and clipping act)
    with the loss type's settings off their defaults: the gradient is finite and not 0, and each metrics line holds
    the loss type's statistics."""
    run = tmp_path / "run"
    proc = run_cli(*ARGS, f"data.path={prompts}", f"recipe.reward_funcs=[{TOY}]", f"recipe.loss_type={loss_type}",
                   *LOSS_SETTINGS.get(loss_type, []), "recipe.num_iterations=2", "train.global_batch_size=8",
                   "train.max_steps=2", "train.eval_every=100", f"hydra.run.dir={run}", env=REWARDS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(str(run))
    assert [m["step"] for m in lines] == [1, 2]
    for line in lines:
        assert math.isfinite(line["loss"]) and 0 < line["grad_norm"] < math.inf, line
        assert all(key in line for key in grpo.METRICS[loss_type]), line


def test_a_loss_types_settings_are_refused_under_the_others(prompts, tmp_path, capsys):
    base = [*ARGS, f"data.path={prompts}", f"recipe.reward_funcs=[{TOY}]"]
    cases = {
        "recipe.sapo_temperature_pos=2.0": "recipe.sapo_temperature_pos=2.0: only recipe.loss_type=sapo reads it "
                                           "(recipe.loss_type=dapo): leave it 1.0",
        "recipe.loss_type=sapo recipe.epsilon=0.3": "recipe.epsilon=0.3: only recipe.loss_type=grpo|bnpo|dr_grpo|"
                                                    "dapo|luspo|cispo reads it (recipe.loss_type=sapo): leave it 0.2",
        "recipe.loss_type=vespo recipe.delta=2.0": "recipe.delta=2.0: only recipe.loss_type=grpo|bnpo|dr_grpo|dapo|"
                                                   "luspo reads it (recipe.loss_type=vespo): leave it null",
        "recipe.loss_type=grpo recipe.vespo_k_neg=1.0": "recipe.vespo_k_neg=1.0: only recipe.loss_type=vespo reads it",
        "recipe.loss_type=cispo recipe.delta=2.0": "recipe.delta=2.0: only recipe.loss_type=grpo|bnpo|dr_grpo|dapo|"
                                                   "luspo reads it (recipe.loss_type=cispo)",
        "recipe.loss_type=cispo recipe.epsilon_high=5.0 recipe.epsilon=0.3":
            "recipe.epsilon=0.3: recipe.loss_type=cispo reads it only while recipe.epsilon_high is null: leave it 0.2",
        "recipe.loss_type=luspo": "recipe.importance_sampling_level='token': recipe.loss_type=luspo takes sequence "
                                  "only (TRL warns on the other)",
        "recipe.loss_type=vespo recipe.importance_sampling_level=sequence":
            "recipe.importance_sampling_level='sequence': recipe.loss_type=vespo takes token only",
        "recipe.loss_type=sapo recipe.sapo_temperature_neg=0": "recipe.sapo_temperature_neg=0.0: must be > 0",
        "recipe.loss_type=vespo recipe.vespo_lambda_pos=-1": "recipe.vespo_lambda_pos=-1.0: must be > 0",
        "recipe.delta=0": "recipe.delta=0.0: must be > 0, or null for no cap",
        "recipe.beta=0 recipe.use_bias_correction_kl=false":
            "recipe.use_bias_correction_kl=False: only recipe.beta > 0 reads it (the KL term it weighs): leave it true",
    }
    for overrides, message in cases.items():
        assert message in compose_refused(tmp_path, capsys, *base, *overrides.split()), overrides
    rloo = [a.replace("recipe=grpo", "recipe=rloo") for a in base]
    assert ("recipe.sapo_temperature_pos=2.0: recipe=rloo reads no sapo_temperature_pos; recipe=grpo does"
            in compose_refused(tmp_path, capsys, *rloo, "recipe.sapo_temperature_pos=2.0"))
    for loss_type, overrides in LOSS_SETTINGS.items():  # each loss type with its own settings composes
        compose_run(tmp_path / loss_type, *base, f"recipe.loss_type={loss_type}", *overrides)


def test_reward_functions_are_checked_as_they_load_and_as_they_return():
    for spec, message in {"tests.trainer.grpo_rewards:missing": "module tests.trainer.grpo_rewards has no missing",
                          "tests.trainer.grpo_rewards:NOT_A_FUNCTION": "NOT_A_FUNCTION is a int, not a function",
                          "tests.trainer.grpo_rewards": "each must be package.module:function"}.items():
        with pytest.raises(ConfigError, match=message):
            reward_funcs.load(spec)
    fn = reward_funcs.load(TOY)
    assert reward_funcs.call(fn, TOY, ["p", "p"], ["ab", "A1"], {}) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="returned list .*one number per completion \\(3\\)"):
        reward_funcs.call(lambda prompts, completions: [1.0], "m:f", ["p"] * 3, ["a"] * 3, {})
    with pytest.raises(ConfigError, match="each reward must be a number"):
        reward_funcs.call(lambda prompts, completions: ["high"], "m:f", ["p"], ["a"], {})
    with pytest.raises(ConfigError, match="not finite"):
        reward_funcs.call(lambda prompts, completions: [float("nan")], "m:f", ["p"], ["a"], {})
    # A function without **kwargs gets only the columns it names.
    length = reward_funcs.load("tests.trainer.grpo_rewards:length")
    assert reward_funcs.call(length, "x", ["p"], ["abcd"], {"target": [4], "other": [1]}) == [1.0]
