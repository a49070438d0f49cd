"""The recipes, `recipe=pretrain|sft`: what a run's loss counts. `config` holds the section's schema and
checks (no torch there: the driver imports it); `sft` turns a chat batch into targets and token weights."""
