"""The draft trainer (`python -m eagle3.train`, also under torchrun)."""
