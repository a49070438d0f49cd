"""The reward functions trainjob ships, to name in `recipe.reward_funcs` (how they are called and checked:
`trainer.rewards.functions`). `contains_answer` is one to start from: 1.0 where the completion holds the row's
`answer` column."""

from __future__ import annotations


def contains_answer(prompts: list, completions: list[str], answer: list) -> list[float]:
    """1.0 for each completion that holds its row's `answer` (as text), else 0.0."""
    return [1.0 if str(a).strip() and str(a).strip() in c else 0.0 for c, a in zip(completions, answer, strict=True)]
