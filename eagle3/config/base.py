"""What every config section is: a model that refuses unknown fields, so a typo fails at load time naming
the field."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from eagle3.procs import ssh_args_problem


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def checked_ssh_args(value: list[str]) -> list[str]:
    if problem := ssh_args_problem(value):
        raise ValueError(problem)
    return value


SshArgs = Annotated[list[str], AfterValidator(checked_ssh_args)]  # options an ssh launcher puts before the host
