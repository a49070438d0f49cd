"""The recipes are objects that own their loss (trainer/recipes/), and one function assembles every model of a
run: the loop reads no batch key and holds no reference, and only `trainer.parallel.assembly` shards a model."""

from __future__ import annotations

import ast
import importlib
import os

from tests.conftest import REPO
from trainer import recipes
from trainer.config.recipe import RECIPES
from trainer.recipes.base import Recipe


def test_every_recipe_has_its_object():
    assert sorted(recipes.OBJECTS) == sorted(RECIPES)
    for module, name in recipes.OBJECTS.values():
        assert issubclass(getattr(importlib.import_module(module), name), Recipe)


def _source(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def test_the_loop_leaves_the_recipe_to_its_object():
    loop = ast.parse(_source("trainer/training/loop.py"))
    strings = {n.value for n in ast.walk(loop) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    attributes = {n.attr for n in ast.walk(loop) if isinstance(n, ast.Attribute)}
    assert not strings & {"loss_mask", "documents", "dpo", "grpo", "kd", "sft"}
    assert not attributes & {"reference", "teacher", "beta"}


def test_one_function_shards_models():
    callers = []
    for root, _, files in os.walk(os.path.join(REPO, "trainer")):
        for name in files:
            if name.endswith(".py") and name != "parallelize.py":  # the one that defines it
                tree = ast.parse(_source(os.path.join(root, name)))
                if any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "parallelize"
                       for n in ast.walk(tree)):
                    callers.append(os.path.relpath(os.path.join(root, name), REPO))
    assert callers == ["trainer/parallel/assembly.py"]


def test_the_recipes_defaults_are_trls_own_for_the_settings_trl_has():
    """conf/recipe/<name>.yaml over the schema, against TRL's config classes installed here (GRPOConfig,
    RLOOConfig, DPOConfig): a config copied from a TRL run means the same. `max_completion_length` is ours (64,
    TRL's 512): it is bounded by data.seq_len + it <= model.max_seq_len, and 512 would not fit model=debug."""
    import dataclasses

    import trl

    from trainer.config.compose import compose
    from trainer.recipes import grpo

    shared = ("beta", "num_generations", "epsilon", "epsilon_high", "loss_type", "temperature", "top_p", "top_k",
              "min_p", "num_iterations", "scale_rewards", "importance_sampling_level", "normalize_advantages",
              "label_smoothing", "reward_weights", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
              "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "use_bias_correction_kl")
    for name, peer in (("grpo", trl.GRPOConfig), ("rloo", trl.RLOOConfig), ("dpo", trl.DPOConfig)):
        ours = compose([f"recipe={name}"]).recipe
        theirs = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                  for f in dataclasses.fields(peer)
                  if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        if isinstance(theirs.get("loss_type"), list):  # DPOConfig's: a list of losses, ["sigmoid"]
            theirs["loss_type"] = theirs["loss_type"][0]
        differ = {k: (ours[k], theirs[k]) for k in shared if k in theirs and k in ours and ours[k] != theirs[k]}
        assert not differ, f"recipe={name}: ours vs TRL {trl.__version__}: {differ}"
    # Each GRPO loss type's own settings (and the KL term's) are GRPOConfig's, by name, and compared above; the loss
    # types are its own.
    assert set(grpo.LOSS_SETTINGS) <= {f.name for f in dataclasses.fields(trl.GRPOConfig)} & set(shared)
    (loss_type,) = [f for f in dataclasses.fields(trl.GRPOConfig) if f.name == "loss_type"]
    named = loss_type.metadata["help"].split("Supported values are ")[1].split(". ")[0]
    assert sorted(grpo.LOSS_TYPES) == sorted(t.strip(" '") for t in named.replace("and ", "").split(","))
