"""trainjob's trainer: the Hydra driver (`python -m trainer`) and the rank entry point (`trainer.worker`)."""

import logging

# torchao (imported by transformers and by our QAT) warns as it is imported: that its optional CUDA extensions
# do not load on a machine without them, and (through torch's pytree) that it registers enums the old way.
# Noise in every run's log that says nothing of the run.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
