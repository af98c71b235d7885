"""Prefect tasks: one module per pipeline stage, each a thin wrapper over one `eagle3` library call."""
