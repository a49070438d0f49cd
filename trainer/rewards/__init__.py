"""The reward functions of recipe=grpo and rloo (`recipe.reward_funcs`): `functions` loads, checks and calls
the ones a config names; `shipped` holds those trainjob ships. No torch: the driver's config checks load them.
(A reward model that scores completions is `trainer.recipes.reward_scorer`; training one is recipe=reward.)"""
