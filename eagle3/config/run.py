"""The run (`run`: its name, directory and process settings) and the target model it drafts for (`target`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from eagle3.config.base import Section


RUN_DIRS = ("data", "vocab", "train", "export", "bench")
DATA_DIRS = ("data", "vocab")  # what a run with run.data_from reads from that directory


class RunSection(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    dir: Path
    data_from: Path | None = Field(
        default=None, description="the run directory whose data and vocab map this run reads instead of making its "
        "own (a contender's: docs/algorithms.md, \"Contenders\"); None: its own")
    keep_runs: int = Field(
        default=3, ge=1, description="retrain run directories (run.dir/retrain-*) of this registry kept, newest "
        "first, when a promotion removes the older ones; the run that built production and running runs are never "
        "removed")
    cpu_threads: int | None = Field(
        default=None, ge=1, description="CPU threads (torch's OpenMP pool) of each busy job the run starts: a "
        "reference server, the trainer (split among its ranks). None: this machine's cores halved, as two jobs can be "
        "busy at once (the production server beside the trainer or a server under test). SGLang servers keep theirs")
    warm_start: bool = Field(default=True, description="local reference servers that end with the run fork from one "
                             "process that imported them (eagle3/warm.py: ~1 s a start, not ~9); false: a new interpreter each")

    def stage_dir(self, stage: str) -> Path:
        """One of the run directory's parts (RUN_DIRS)."""
        if stage not in RUN_DIRS:
            raise ValueError(f"unknown run directory {stage!r}; they are {', '.join(RUN_DIRS)}")
        return (self.data_from if self.data_from is not None and stage in DATA_DIRS else self.dir) / stage

    @property
    def data_dir(self) -> Path:
        """The run directory that made the data this run reads: its token is in every key."""
        return self.data_from or self.dir


class TargetSection(Section):
    path: str = Field(min_length=1, description="target model directory (or hub id on the GPU node)")
    family: str = Field(
        pattern=r"^[a-z0-9_]+$",
        description="SGLang model file that serves the target, e.g. llama, deepseek_v2, kimi_k25",
    )
    num_hidden_layers: int = Field(gt=1)
    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    weight_prefix: str = Field(default="", description="name prefix of the target's tensors, e.g. 'language_model.'")
    trust_remote_code: bool = Field(
        default=False, description="run the Python files the target's tokenizer_config.json / config.json name in "
        "auto_map (Kimi's tokenization_kimi.py): every load of its tokenizer, config and model, and SGLang's "
        "--trust-remote-code; a target that needs them fails at config load without it")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="the one precision the target runs in on this machine (data stage generation, "
        "held-out continuations, the reference server, CPU features); auto: its config's torch_dtype, else float32")
    config_file: Path | None = Field(
        default=None, description="the target's config.json where target.path is no local model directory (a hub "
        "id, or a path only the GPU node has): `eagle3 plan` sizes the target from it")
