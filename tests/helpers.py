"""Helpers the test modules share (imported from here, never from another test module)."""

from __future__ import annotations

from eagle3.stages.table import Stage, StageRun, output_of


def write_seed(run: StageRun) -> None:
    out = output_of(run.config, "toy")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{run.config.training.seed} {run.config.vocab.draft_vocab_size}\n")
    run.log(f"toy: wrote {out}")


# a stage a test adds to eagle3.stages.table.STAGES: one entry and its runner
TOY = Stage("toy", "toy/seed.txt", key=("training.seed",), runner=write_seed, command=("toy",),
            help="a toy stage: the seed and the draft vocabulary's size", upstream={"vocab": "vocab"})
