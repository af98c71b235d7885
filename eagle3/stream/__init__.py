"""Streamed features (`training.features streamed`): the target runs outside the training world.

    capture workers ──put──▶ Mooncake store ◀──get── trainers (any torchrun world, any nodes)
           │ claim / captured        ▲ remove            │ want / take / consumed / lost
           └──────────────▶ coordinator (ledger, watermarks) ◀──┘

- `store`: the Mooncake client, the master the pipeline may start, and the content key of a sample's features.
- `ledger`: which samples are wanted, claimed, captured and consumed, in SQLite under the run's train/stream/.
- `coordinator`: hands samples to workers in the trainers' order, pauses them between the watermarks, frees what the
  trainers consumed; served over HTTP to the workers and trainers.
- `worker`: one per target replica: claims samples, prefills them, puts their features into the store.
- `features`: the trainers' feature backend: announces the order it will read, takes each micro-batch by key.
- `session`: what the train stage starts around the trainers, and stops after them.

docs/streamed-features.md describes the protocol, the faults it survives and the multi-node layout.
"""
