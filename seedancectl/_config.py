"""The sidecar's configuration: one TOML file, environment overrides, flags on top.

Validation errors name the field and the file, in one line, because the person reading them is
an operator at a terminal, not a developer reading a traceback.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from collectors._errors import SeedanceError

ENV_PREFIX = "SEEDANCE_"


class ConfigError(SeedanceError):
    """The configuration file or an override is invalid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScrapeConfig(_Section):
    """An exporter the user already runs (dcgm-exporter, vLLM) that the sidecar scrapes."""

    url: str
    kind: Literal["auto", "dcgm", "vllm"] = "auto"
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)


class SidecarConfig(_Section):
    """Everything `seedancectl sidecar` needs; every field has a safe default."""

    job: str = "default"
    listen: str = "127.0.0.1:4318"
    store: Path = Path("seedance-data/metrics.db")
    state_db: str = "sqlite:///seedance-data/state.db"
    upstream_otlp_endpoint: str | None = None
    prometheus_port: int | None = Field(default=None, ge=1, le=65535)
    nvml: Literal["auto", "off"] | str = "auto"
    nvml_interval_s: float = Field(default=1.0, gt=0)
    export_interval_s: float = Field(default=1.0, gt=0)
    max_body_bytes: int = Field(default=8 * 2**20, gt=0)
    scrape: tuple[ScrapeConfig, ...] = ()

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT, got {value!r}")
        return value

    @field_validator("nvml")
    @classmethod
    def _check_nvml(cls, value: str) -> str:
        if value in ("auto", "off") or value.startswith("replay:"):
            return value
        raise ValueError(f"expected 'auto', 'off' or 'replay:TRACE', got {value!r}")

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def _one_line(error: ValidationError, where: str) -> str:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(top level)"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{where}: {field}: {first['msg']}{more}"


def _env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """SEEDANCE_LISTEN=... overrides `listen`; only top-level scalar fields."""
    fields = SidecarConfig.model_fields
    return {
        key[len(ENV_PREFIX):].lower(): value
        for key, value in environ.items()
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in fields
        and key[len(ENV_PREFIX):].lower() != "scrape"
    }


def load_config(
    path: Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> SidecarConfig:
    """File, then SEEDANCE_* environment, then explicit overrides (CLI flags), validated once."""
    data: dict[str, Any] = {}
    where = "configuration"
    if path is not None:
        where = str(path)
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        data = data.get("sidecar", data)
    data.update(_env_overrides(os.environ if environ is None else environ))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return SidecarConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, where)) from None
