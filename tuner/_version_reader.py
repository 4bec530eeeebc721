"""What one job emitted under one config version: every apply gets a fresh version and every
point carries it, so a version's points are exactly one window of one config."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pandas as pd

from collectors import CONFIG_VERSION_ATTR, BoundsReader, Resolution, StoreReader, ValueBounds
from collectors.names import ATTR_SERVICE_NAME


class VersionReader:
    """A ``StoreReader`` narrowed to the points ``job`` emitted under ``version``; raw points
    unless asked otherwise. Its series start with the version, so a cumulative series' last
    value is the version's whole count."""

    def __init__(self, reader: StoreReader, job: str, version: int) -> None:
        self._reader = reader
        self._bound = {ATTR_SERVICE_NAME: job, CONFIG_VERSION_ATTR: str(version)}

    def query(self, name: str, *, where: Mapping[str, str] | None = None,
              since_ns: int | None = None, until_ns: int | None = None,
              resolution: Resolution = "raw") -> pd.DataFrame:
        """Points of ``name`` the job emitted under the bound version."""
        return self._reader.query(name, where={**(where or {}), **self._bound},
                                  since_ns=since_ns, until_ns=until_ns, resolution=resolution)

    def value_bounds(self, name: str, *, where: Mapping[str, str] | None = None,
                     keep: Callable[[Mapping[str, str]], bool], since_ns: int,
                     until_ns: int) -> ValueBounds | None:
        """Bounds on the values of ``name`` the job emitted under the bound version, from the
        reader's own when it keeps them (None otherwise: the caller reads the points)."""
        if not isinstance(self._reader, BoundsReader):
            return None
        return self._reader.value_bounds(name, where={**(where or {}), **self._bound},
                                         keep=keep, since_ns=since_ns, until_ns=until_ns)
