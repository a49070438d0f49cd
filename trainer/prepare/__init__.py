"""The driver's preparation of a run, before anything starts: `preflight` (the config checked, `check`),
`inputs` (the input checks the driver and the ranks share: corpus, cache nodes, checkpoint, memory),
`callbacks` (Hydra's callback: a run's or a sweep's every job checked first) and `run_dir` (the run
directory claimed, and removed when a run is refused). Importing this package loads none of them."""
