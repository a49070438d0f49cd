"""Where users keep models, data and checkpoints: URLs (`hf://`, `s3://`, `gs://`) beside local paths. `urls` tells
a URL from a path and names its scheme; `errors` holds `StorageError`, what every refusal of a store raises;
`objects` reaches s3:// and gs:// (`filesystem`: a URL's pyarrow filesystem and path; `listing`: its objects with
their ETags), `hub` the Hugging Face Hub (hf://); `fetch` is the one way a URL becomes local files, in a cache keyed
by the objects' versions."""
