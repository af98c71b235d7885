"""eagle3: a pipeline that trains, validates and ships EAGLE-3 draft models."""

__version__ = "0.1.0"
