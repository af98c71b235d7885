"""The pipeline's stages: the one table of them (`table`), their keys and markers (`keys`), and running one, from
the flow or by hand (`run`); another draft replayed over the simulate stage's inputs, beside its output (`drafts`)."""
