"""The recipes are objects that own their loss (trainer/recipes/), and one function assembles every model of a
run: the loop reads no batch key and holds no reference, and only `trainer.models.assembly` shards a model."""

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
    loop = ast.parse(_source("trainer/loop.py"))
    strings = {n.value for n in ast.walk(loop) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    attributes = {n.attr for n in ast.walk(loop) if isinstance(n, ast.Attribute)}
    assert not strings & {"loss_mask", "documents", "dpo", "grpo", "kd", "sft"}
    assert not attributes & {"reference", "teacher", "beta"}


def test_one_function_shards_models():
    callers = []
    for root, _, files in os.walk(os.path.join(REPO, "trainer")):
        for name in files:
            if name.endswith(".py") and "parallel" not in root:
                tree = ast.parse(_source(os.path.join(root, name)))
                if any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "parallelize"
                       for n in ast.walk(tree)):
                    callers.append(os.path.relpath(os.path.join(root, name), REPO))
    assert callers == ["trainer/models/assembly.py"]
