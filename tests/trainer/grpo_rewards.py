"""Reward functions that tests/trainer/recipes/test_grpo.py names in `recipe.reward_funcs`: the toy task's, and ones a
run must refuse."""

from __future__ import annotations

import string


def lowercase(prompts, completions, **kwargs):
    """The share of a completion's characters that are lowercase ASCII letters (a tenth of the bytes: a reward
    that an untrained model already meets now and then, so every group has something to compare)."""
    return [sum(c in string.ascii_lowercase for c in text) / max(len(text), 1) for text in completions]


def length(prompts, completions, target):
    """1 minus how far the completion's length is from the row's `target` column, in characters (at most 1)."""
    return [max(0.0, 1 - abs(len(text) - int(t)) / 8) for text, t in zip(completions, target, strict=True)]


def no_completions(prompts, answers):
    return [0.0 for _ in prompts]


def needs_a_column(prompts, completions, difficulty):
    return [0.0 for _ in completions]


NOT_A_FUNCTION = 3


_calls = {"server_down": 0}


def server_down(prompts, completions, **kwargs):
    """A reward that asks a server, which goes down after two calls (each rank counts its own)."""
    _calls["server_down"] += 1
    if _calls["server_down"] > 2:
        return _ask_server(completions)
    return [0.5 for _ in completions]


def _ask_server(texts):
    raise ConnectionError(f"reward server http://127.0.0.1:9/score is down ({len(texts)} completions unscored)")
