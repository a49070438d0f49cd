"""The reward function that tests/trainer/recipes/test_ppo.py names in `recipe.reward_funcs`: one letter preferred."""

from __future__ import annotations


def count_e(prompts, completions, **kwargs):
    """How many "e" a completion holds."""
    return [float(text.count("e")) for text in completions]
