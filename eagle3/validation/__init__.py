"""Checking a draft against what a serving engine will do with it, and judging drafts trained elsewhere."""
