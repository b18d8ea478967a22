"""Common pydantic base: frozen, no unknown keys, so a typo in a YAML or plan file is an error."""
from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """Base of every spec, plan and result object: immutable and strict about field names."""

    model_config = ConfigDict(extra="forbid", frozen=True)
