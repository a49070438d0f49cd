"""Where users keep models, data and checkpoints: URLs (`hf://`, `s3://`, `gs://`) beside local paths. `urls` tells
a URL from a path and names its scheme; `errors` holds `StorageError`, what every refusal of a store raises. `objects` (s3://, gs://: `filesystem`, the pyarrow
filesystem of a URL; `listing`, its objects with their ETags) and `hub` (hf://) reach the stores; `fetch` is the
one way a URL becomes local files, in a cache keyed by the objects' versions."""
