"""The `contenders` section: other drafts a run trains on its own data and measures beside its own, the gate promoting
the fastest (docs/algorithms.md, "Contenders"). Each contender is the run's config with its own fields over it, in the
sections that describe a draft and how it is trained and served; everything the data, capture and vocab stages read
stays the run's."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from eagle3.config.base import Section

CONTENDERS_DIR = "contenders"  # under run.dir: contenders/<name>/{train,export,bench}
# serving fields a contender may set: its drafting shape (a block draft's block is a chain of num_steps)
SHAPE_FIELDS = ("num_steps", "eagle_topk", "num_draft_tokens")
# what the stages every draft of a run shares (regenerate, capture, vocab: eagle3.stages.table) read of the sections a
# contender sets, which it may not change (tests/test_contenders.py holds this against the table); its shape it may:
# the held-out continuations run as deep as any draft's deepest shape (eagle3.data.regenerate.greedy_length)
SHARED_TRAINING = ("features", "replay_prompts", "replay_max_new_tokens")


class ContenderSection(Section):
    draft: dict[str, Any] = Field(default_factory=dict, description="fields over the run's draft section "
                                  "(algorithm, its own section, sizes)")
    training: dict[str, Any] = Field(default_factory=dict, description="fields over the run's training section "
                                     "(not what the capture reads: training.features)")
    serving: dict[str, Any] = Field(default_factory=dict, description=f"its drafting shape: {', '.join(SHAPE_FIELDS)}")
    sweep: dict[str, Any] = Field(default_factory=dict, description="its sweep.points (a block draft's are chains "
                                  "in blocks no longer than it was trained on)")
