"""What a run reports: the metrics lines (`metrics`), the trackers they go to (`trackers`), the progress line
(`progress`), the loss pictures (`plots`), and the sweep report (`report`, `python -m
trainer.observability.report`)."""
