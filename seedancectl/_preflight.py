"""What the sidecar needs before it starts, checked before its banner and by `config check`:
the files it will write are writable, a PostgreSQL state database answers, the token files it
will read are there and not empty, TLS files are readable. Each failure is one line naming the setting (ConfigError), never a
traceback after "listening on"."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import make_url

from collectors import ping_state_db
from seedancectl._config import ConfigError, SidecarConfig
from tuner import TokenError, read_token


def preflight(config: SidecarConfig) -> None:
    """Raise ConfigError for the first setting the sidecar could not use."""
    _writable_file(config.store, "store")
    state = make_url(config.state_db)
    if state.get_backend_name() == "sqlite" and state.database not in (None, "", ":memory:"):
        _writable_file(Path(state.database), "state_db")
    elif state.get_backend_name() == "postgresql":
        ping_state_db(config.state_db)
    tokens = {"token_file": config.token_file, "ingest_token_file": config.ingest_token_file,
              **{f"jobs.{name}.token_file": job.token_file
                 for name, job in config.jobs.items()}}
    for setting, path in tokens.items():
        if path is not None:
            try:
                read_token(path)
            except TokenError as exc:
                raise ConfigError(f"{setting}: {exc}") from None
    for setting, path in (("tls_cert_file", config.tls_cert_file),
                          ("tls_key_file", config.tls_key_file)):
        if path is not None and not os.access(path, os.R_OK):
            raise ConfigError(f"{setting}: {path} is not a readable file")
    if config.token_file is None:  # the sidecar generates one next to its store
        _writable_file(config.state_dir / "token", "token_file (generated)")


def _writable_file(path: Path, setting: str) -> None:
    """``path`` can be written: it is a writable file, or the nearest folder that exists on
    the way to it is writable (the sidecar creates the rest)."""
    if path.is_dir():
        raise ConfigError(f"{setting}: {path} is a folder; give a file in it")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{setting}: {path} is not writable")
        return
    folder = path.parent.absolute()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{setting}: {folder} is not a folder, so {path} cannot be created")
    if not os.access(folder, os.W_OK | os.X_OK):
        reason = "a read-only file system" if _read_only(folder) else "not writable"
        raise ConfigError(f"{setting}: cannot create {path}: {folder} is {reason}")


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False
