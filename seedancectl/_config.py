"""The sidecar's configuration: one TOML file, environment overrides, flags on top.

Validation errors name the field and the file, in one line, because the person reading them is
an operator at a terminal, not a developer reading a traceback.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from collectors import ConfigError, state_url

ENV_PREFIX = "SEEDANCE_"
ApprovalMode = Literal["auto", "suggest", "off"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScrapeConfig(_Section):
    """An exporter the user already runs (dcgm-exporter, vLLM) that the sidecar scrapes."""

    url: str
    kind: Literal["auto", "dcgm", "vllm"] = "auto"
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _timeout_within_interval(self) -> ScrapeConfig:
        if self.timeout_s > self.interval_s:
            raise ConfigError(f"timeout_s ({self.timeout_s:g}) must be <= interval_s "
                             f"({self.interval_s:g}): scrapes would pile up")
        return self


class KnobBound(_Section):
    """What auto-approval allows for one knob: a range (``low``..``high``) or ``allowed`` values.

    Only live, low-risk changes are ever auto-approved; a bound narrows that further.
    """

    low: float | None = None
    high: float | None = None
    allowed: tuple[bool | int | float | str, ...] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> KnobBound:
        ranged = self.low is not None or self.high is not None
        if ranged == (self.allowed is not None):
            raise ConfigError("give either low and high, or allowed")
        if ranged and (self.low is None or self.high is None or self.low > self.high):
            raise ConfigError("low and high must both be set, low <= high")
        if self.allowed is not None and not self.allowed:
            raise ConfigError("allowed must list at least one value")
        return self

    def for_controller(self) -> tuple[float, float] | frozenset[bool | int | float | str]:
        """The form ``tuner.RolloutConfig.auto_bounds`` takes."""
        if self.allowed is not None:
            return frozenset(self.allowed)
        assert self.low is not None and self.high is not None
        return (self.low, self.high)


class ApprovalConfig(_Section):
    """Who approves: the default mode, how long a proposal waits, the auto-approval bounds."""

    mode: ApprovalMode = "suggest"
    proposal_ttl_s: float = Field(default=3600.0, gt=0)
    bounds: dict[str, KnobBound] = Field(default_factory=dict)


class RolloutSection(_Section):
    """How the controller observes a change (``tuner.RolloutConfig`` and ``MeasureConfig``):
    interleaved candidate and baseline windows, each ``warmup_steps`` dropped then at least
    ``min_steps`` steps and ``min_window_s`` seconds measured, pairs added until a sequential
    test decides (from ``min_pairs`` on) or ``max_pairs`` / ``trial_budget_s`` run out.
    Tokens/s comes from the job's own token count; ``tokens_per_step`` is only for senders
    that do not count tokens. Every default is meant to work on any job."""

    min_pairs: int = Field(default=3, ge=1)
    max_pairs: int = Field(default=24, ge=1)
    trial_budget_s: float = Field(default=90.0, gt=0)
    min_gain: float = Field(default=0.03, ge=0)
    max_slowdown: float = Field(default=0.4, ge=0, lt=1)
    early_stop_pairs: int = Field(default=2, ge=1)
    ack_timeout_s: float = Field(default=60.0, gt=0)
    restore_attempts: int = Field(default=3, ge=1)
    window_timeout_s: float = Field(default=600.0, gt=0)
    warmup_steps: int = Field(default=1, ge=0)
    min_steps: int = Field(default=3, ge=1)
    min_window_s: float = Field(default=2.0, gt=0)
    max_window_s: float = Field(default=30.0, gt=0)
    tokens_per_step: float | None = Field(default=None, gt=0)
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    loss_tolerance: float = Field(default=0.05, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> RolloutSection:
        if self.min_pairs > self.max_pairs:
            raise ConfigError("min_pairs must be <= max_pairs")
        if self.min_window_s > self.max_window_s:
            raise ConfigError("min_window_s must be <= max_window_s")
        return self


class JobConfig(_Section):
    """One job's tuning: approval mode (default: ``approval.mode``), whether the search runs,
    which knobs it searches (default: the job's live knobs; within ``approval.bounds``), its
    Optuna study name and sampler seed, and ``token_file``: a token the operator issued to this
    job alone, which it may use for its lease (attach, lease, ack) besides the sidecar's own."""

    mode: ApprovalMode | None = None
    tune: bool = False
    knobs: tuple[str, ...] | None = None
    study: str | None = None
    seed: int | None = None
    token_file: Path | None = None


class ServingSLOConfig(_Section):
    """The serving guardrail: roll back when p99 latency or token agreement breaks its bound.
    It is on for every serving job: without this section, with no absolute p99 SLO and the
    default token-agreement bound."""

    p99_slo_s: float | None = Field(default=None, gt=0)
    quantile: float = Field(default=0.99, gt=0, lt=1)
    min_token_agreement: float = Field(default=0.98, ge=0, le=1)
    min_requests: int = Field(default=20, ge=1)


class KvDecompressionSection(_Section):
    """What the KV decompression-cost detector weighs a compressed cache against: facts of
    the serving engine the sidecar cannot measure (``policies.detectors.KvDecompressionConfig``
    says what each is). Its defaults suit no engine in particular: set ``max_batch_size`` and
    ``kv_budget_bytes`` to the engine's, and ``uncompressed_read_bytes_per_s`` for an engine
    that copies the whole cache every step (a concatenating cache), whose copy dequantising
    replaces. A mirror, not the dataclass itself: importing ``policies`` imports pandas, which
    every CLI command would pay for (0.37 s); a test keeps the two field for field."""

    max_batch_size: int = Field(default=64, ge=1)
    kv_budget_bytes: float | None = Field(default=None, gt=0)
    min_dequant_share: float = Field(default=0.02, ge=0, lt=1)
    min_gain: float = Field(default=0.0, ge=0)
    tpot_slo_s: float | None = Field(default=None, gt=0)
    min_tokens: float = Field(default=100.0, gt=0)
    fixed_step_share: float = Field(default=0.7, ge=0, lt=1)
    uncompressed_read_bytes_per_s: float | None = Field(default=None, gt=0)


class SidecarConfig(_Section):
    """Everything `seedancectl sidecar` needs; every field has a safe default."""

    job: str = "default"
    listen: str = "127.0.0.1:4318"
    store: Path = Path("seedance-data/metrics.db")
    store_max_mib: float | None = Field(default=None, ge=0.0625)
    state_db: str = "sqlite:///seedance-data/state.db"
    """Default: ``state.db`` next to ``store``, so that one folder holds the sidecar's data."""
    upstream_otlp_endpoint: str | None = None
    prometheus_port: int | None = Field(default=None, ge=1, le=65535)
    metrics_source: str = "store"
    """Where the policy engine, the rollout's measurement and guardrails, the searches and the
    report read series: ``store`` (the embedded one) or ``prometheus:http(s)://HOST:PORT`` (a
    Prometheus that scrapes the sidecars' /metrics). The store receives and serves /metrics
    either way."""
    nvml: Literal["auto", "off"] | str = "auto"
    nvml_interval_s: float = Field(default=1.0, gt=0)
    export_interval_s: float = Field(default=1.0, gt=0)
    max_body_bytes: int = Field(default=8 * 2**20, gt=0)
    max_series_per_metric: int = Field(default=2000, ge=1)
    max_series_per_job: int = Field(default=20_000, ge=1)
    series_idle_s: float = Field(default=600.0, gt=0)
    scrape: tuple[ScrapeConfig, ...] = ()
    token_file: Path | None = None
    ingest_token_file: Path | None = None
    allow_insecure_ingest: bool = False
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    allow_insecure_listen: bool = False
    webhook_url: str | None = None
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    policy_interval_s: float = Field(default=5.0, gt=0)
    policy_window_s: float = Field(default=300.0, gt=0)
    policy_open_after: int = Field(default=2, ge=1)
    policy_close_after: int = Field(default=2, ge=1)
    tuning_interval_s: float = Field(default=1.0, gt=0)
    tuning_start_after_s: float = Field(default=15.0, ge=0)
    tuning_revisit_after_s: float | None = Field(default=300.0, gt=0)
    lease_ttl_s: float = Field(default=10.0, gt=0)
    advertise_url: str | None = None
    """The URL other sidecars and the CLI reach this sidecar's API at (the fleet registry
    shares it); default: from ``listen`` and TLS, this host's name for a wildcard address."""
    fleet_heartbeat_s: float = Field(default=2.0, gt=0)
    """How often the sidecar tells the fleet it is alive; after 3 periods of silence its jobs
    may be claimed by another sidecar. Every sidecar of a fleet should use the same."""
    nice: int = Field(default=5, ge=0, le=19)
    """How far the sidecar lowers the CPU priority of its bulk work (Unix niceness, added to
    what it started with): it shares cores with the job it watches, and its bursts (a policy
    pass, a flush, decoding) must not stall the job's threads. On Linux only the bulk threads
    are lowered, and the threads that answer the API and the jobs' leases keep the priority it
    started with; elsewhere the whole process. 0 keeps the priority it was started with.

    Not 10: the answering threads share one interpreter lock with the bulk threads, and a bulk
    thread that holds it when the kernel preempts it makes every answer wait until it runs
    again, which at +10 on a busy node is tens of milliseconds (``docs/tuning.md``)."""
    price_per_gpu_hour: float = Field(default=2.5, gt=0)
    currency: str = Field(default="USD", pattern=r"^[A-Za-z$€£¥]{1,8}$")
    """What one GPU-hour costs, in ``currency``: the report's money figures."""
    approval: ApprovalConfig = ApprovalConfig()
    rollout: RolloutSection = RolloutSection()
    jobs: dict[str, JobConfig] = Field(default_factory=dict)
    serving_slo: ServingSLOConfig = ServingSLOConfig()
    kv_decompression: KvDecompressionSection = KvDecompressionSection()

    @model_validator(mode="before")
    @classmethod
    def _state_db_beside_store(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("state_db") is None and data.get("store"):
            return {**data, "state_db": f"sqlite:///{Path(data['store']).parent / 'state.db'}"}
        return data

    @field_validator("webhook_url", "advertise_url")
    @classmethod
    def _check_http_url(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("http", "https"):
            raise ConfigError(f"expected an http(s) URL, got {value!r}")
        return value

    @field_validator("metrics_source")
    @classmethod
    def _check_metrics_source(cls, value: str) -> str:
        url = value.removeprefix("prometheus:")
        if value != "store" and (url == value or not _prometheus_url(url)):
            raise ConfigError(f"expected 'store' or 'prometheus:http(s)://HOST:PORT', "
                              f"got {value!r}")
        return value

    @property
    def telemetry_job(self) -> str:
        """The job name the sidecar's own telemetry carries (service.name)."""
        return f"{self.job}-sidecar"

    @property
    def prometheus_url(self) -> str | None:
        """The Prometheus that ``metrics_source`` names, or None for the embedded store."""
        return None if self.metrics_source == "store" \
            else self.metrics_source.removeprefix("prometheus:")

    @field_validator("state_db")
    @classmethod
    def _check_state_db(cls, value: str) -> str:
        try:
            state_url(value)
        except ConfigError as exc:  # pydantic names the field already
            raise ConfigError(str(exc).removeprefix("state_db: ")) from None
        return value

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"expected HOST:PORT, got {value!r}")
        return value

    @model_validator(mode="after")
    def _exposed_safely(self) -> SidecarConfig:
        """Off loopback, the API needs TLS and OTLP ingest a token, unless the operator says
        otherwise in so many words."""
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.loopback:
            return self
        if self.tls_cert_file is None and not self.allow_insecure_listen:
            raise ConfigError(
                f"listen = {self.listen!r} is reachable from other hosts: serve it over TLS "
                "(tls_cert_file and tls_key_file), or set allow_insecure_listen = true")
        if self.ingest_token_file is None and not self.allow_insecure_ingest:
            raise ConfigError(
                f"listen = {self.listen!r} is reachable from other hosts, and OTLP ingest "
                "decides what is kept: set ingest_token_file, or allow_insecure_ingest = true")
        return self

    @property
    def loopback(self) -> bool:
        """Whether ``listen`` is reachable from this host only."""
        host = self.host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False  # a name other hosts may resolve to this one

    @field_validator("nvml")
    @classmethod
    def _check_nvml(cls, value: str) -> str:
        if value in ("auto", "off") or value.startswith("replay:"):
            return value
        raise ConfigError(f"expected 'auto', 'off' or 'replay:TRACE', got {value!r}")

    def job_config(self, job: str) -> JobConfig:
        """The job's section, or the defaults for a job the file does not name."""
        return self.jobs.get(job, JobConfig())

    @property
    def state_dir(self) -> Path:
        """Where the sidecar keeps its own files (the generated token): the store's folder."""
        return self.store.parent

    @property
    def advertised_url(self) -> str:
        """``advertise_url``, else ``listen`` as a URL (https with TLS); a wildcard address
        (0.0.0.0, ::) is named by this host's name, which the others can resolve."""
        if self.advertise_url is not None:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        scheme = "https" if self.tls_cert_file is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def _prometheus_url(url: str) -> bool:
    """An http(s) URL with a host, a port in range if any, no query and no fragment."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # a port out of range or not a number
        return False
    return (parts.scheme in ("http", "https") and bool(parts.hostname) and port_ok
            and not parts.query and not parts.fragment)


def _one_line(error: ValidationError, where: str) -> str:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(top level)"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{where}: {field}: {first['msg']}{more}"


_NOT_FROM_ENV = frozenset({"scrape", "approval", "jobs", "serving_slo", "rollout",
                           "kv_decompression"})


def _env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """SEEDANCE_LISTEN=... overrides `listen`; only top-level scalar fields."""
    fields = SidecarConfig.model_fields
    return {
        key[len(ENV_PREFIX):].lower(): value
        for key, value in environ.items()
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in fields
        and key[len(ENV_PREFIX):].lower() not in _NOT_FROM_ENV
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
        except (OSError, UnicodeDecodeError) as exc:  # a folder, no permission, not UTF-8
            raise ConfigError(f"{path}: cannot read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        if "sidecar" in data:
            outside = sorted(set(data) - {"sidecar"})
            if outside:
                raise ConfigError(f"{path}: {', '.join(outside)}: outside [sidecar], where "
                                  "nothing reads it (move it under [sidecar])")
            data = data["sidecar"]
    data.update(_env_overrides(os.environ if environ is None else environ))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return SidecarConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, where)) from None
