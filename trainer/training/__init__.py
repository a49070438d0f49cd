"""The training stage on a rank: `loop` (micro-batches, clipping, the optimizer's step, eval, checkpoints,
the summary), `optimizer` (the optimizer and its LR schedule, the settings a resume keeps from config) and
`preemption` (SIGTERM: the ranks agree, checkpoint, exit with the preemption code)."""
