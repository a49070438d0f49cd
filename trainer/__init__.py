"""trainjob's trainer: the Hydra driver (`python -m trainer`) and the rank entry point (`trainer.worker`)."""
