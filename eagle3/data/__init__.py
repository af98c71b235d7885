"""Prompt sources, answer regeneration by the target, hidden-state capture, dataset shards."""
