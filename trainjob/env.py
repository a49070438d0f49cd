"""The environment-variable names and the exit codes that the processes of a run pass each other: the driver,
the runtime's agent on each node (torchrun's, `trainjob.runtimes.torch_distributed.torchrun`), the ranks and the
data cache's nodes."""

# Set in the ranks' environment where the driver waits for them on this machine's disk and reports their
# failures itself: a rank whose user code failed leaves its report in <run_dir>/logs/rank-<R>.error and prints
# nothing (every rank may fail alike), and the agent prints no summary of its own.
DRIVER_REPORTS_ENV = "TRAINJOB_DRIVER_REPORTS"

# What the agent exits with when the rendezvous timed out waiting for the other nodes (runtime.rdzv_timeout).
RDZV_TIMEOUT_EXIT = 3

# The data cache's shared secret, where `python -m datacache`, its nodes and StreamingDataset find a token that
# was not given (a run's config.yaml names this variable, never the token).
CACHE_TOKEN_ENV = "TRAINJOB_CACHE_TOKEN"

# The data cache nodes a launcher started beside the ranks (the launch spec's cache nodes): the training rows' and
# the eval rows' endpoints, as lists in OmegaConf's syntax that the run's config reads with
# `${oc.decode:${oc.env:...}}`.
CACHE_ENDPOINTS_ENV = "TRAINJOB_CACHE_ENDPOINTS"
CACHE_EVAL_ENDPOINTS_ENV = "TRAINJOB_CACHE_EVAL_ENDPOINTS"
