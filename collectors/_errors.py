"""The project's one error hierarchy; vendor errors are translated into it at the boundary."""

from __future__ import annotations


class SeedanceError(Exception):
    """Base of every error the project raises on purpose; its message is one line for a user."""


class ConfigError(SeedanceError, ValueError):
    """A configuration value out of its domain; a ``ValueError`` too, so validators that expect
    one (pydantic's) still turn it into their own report."""
