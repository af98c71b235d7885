"""Acceptance measurement: the offline simulator (and, later, the serving benchmark)."""
