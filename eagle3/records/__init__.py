"""Run records: the manifest every stage output carries, and what a serving engine reports."""
