"""Serving: the reference server (SGLang's HTTP API subset on a transformers target)."""
