"""The recipes, `recipe=pretrain|sft|dpo`: what a run's loss counts. The section's schema and checks are in
`trainer.config.recipe` (no torch there: the driver imports it); `sft` turns a chat batch into targets and
token weights; `dpo` holds the preference loss."""
