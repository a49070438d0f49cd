"""The reward function that tests/trainer/recipes/test_ppo.py names in `recipe.reward_funcs`: one token preferred."""

from __future__ import annotations


def letter_e(prompts, completions, **kwargs):
    """The share of a completion's characters that are "e" (one byte-level token of the debug model)."""
    return [text.count("e") / max(len(text), 1) for text in completions]


def count_e(prompts, completions, **kwargs):
    """How many "e" a completion holds."""
    return [float(text.count("e")) for text in completions]
