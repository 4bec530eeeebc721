"""Where a caller of the sidecar finds its bearer token: the CLI for the operator API, and the
in-job clients for the lease (attach, lease, ack), which are closed to anonymous callers.

One order everywhere: a file named explicitly, else ``$SEEDANCE_TOKEN``, else the file
``$SEEDANCE_TOKEN_FILE`` names, else ``seedance-data/token`` in the working directory (where a
sidecar started with the default settings writes the token it generated). Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from collectors import SeedanceError

TOKEN_ENV = "SEEDANCE_TOKEN"
TOKEN_FILE_ENV = "SEEDANCE_TOKEN_FILE"
DEFAULT_TOKEN_FILE = Path("seedance-data/token")


class TokenError(SeedanceError):
    """A token file that cannot be read or is empty."""


def read_token(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise TokenError(f"token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise TokenError(f"token file {path} is empty")
    return token


def find_token(token_file: Path | None = None,
               environ: Mapping[str, str] | None = None, *,
               default_file: Path = DEFAULT_TOKEN_FILE) -> str | None:
    """The caller's token in the order above; None when there is none. ``default_file`` is
    where the last step looks (the CLI passes its configuration's token file)."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        return read_token(token_file)
    if env.get(TOKEN_ENV, "").strip():
        return env[TOKEN_ENV].strip()
    if env.get(TOKEN_FILE_ENV):
        return read_token(Path(env[TOKEN_FILE_ENV]))
    if default_file.is_file():
        return read_token(default_file)
    return None
