"""Draft registry, promotion gate and rollback."""
