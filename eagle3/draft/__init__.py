"""The draft's representation on disk: its layouts (native, sglang, speculators), checkpoints and conversion, the vocabulary map, and their diagnosis."""
