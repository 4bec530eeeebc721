"""The in-job sessions' errors (one tree with the rest: ``collectors.SeedanceError``)."""

from __future__ import annotations

from collectors import SeedanceError


class ClientError(SeedanceError):
    """The session is used in a way it cannot honour (a knob declared too late, say)."""


class ConfigRefusedError(ClientError):
    """The config failed before in this process (shadow step or a step under it)."""


class ServeClientError(SeedanceError):
    """The serving session is used in a way it cannot honour."""
