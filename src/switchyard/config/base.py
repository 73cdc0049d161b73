"""What every settings section shares: a strict, immutable base model, the error a bad
config raises, and the pattern of a client-visible model name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


class ConfigError(Exception):
    """The config cannot be used; the message names the key and the fix."""


class Strict(BaseModel):
    # Unknown keys are errors, settings are immutable, and each field's description (shown
    # in the generated configuration reference) is the string literal under it.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
