"""Draft registry, promotion gate and rollback.

- `store`, `s3`: the object stores (a local directory, an S3 bucket) with verified uploads and a compare-and-swap
  `put_if`;
- `registry`: versions, the production pointer, the decision history (`open_registry(config.registry)`);
- `gate`: the pure promotion decision.
"""
