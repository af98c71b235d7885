"""Prefect flows: the `eagle3` flow and its deployments' entry points; flows only sequence tasks."""
