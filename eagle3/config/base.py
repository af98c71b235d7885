"""What every config section is: a model that refuses unknown fields, so a typo fails at load time naming
the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
