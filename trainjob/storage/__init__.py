"""Where users keep models, data and checkpoints: URLs (`hf://`, `s3://`, `gs://`) beside local paths. `urls` tells
a URL from a path and names its scheme; `errors` holds `StorageError`, what every refusal of a store raises."""
