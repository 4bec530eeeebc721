"""What the sidecar's HTTP API answers, as types: the JSON bodies that ``SidecarClient`` returns.

They are TypedDicts, not classes, because a body is passed on as it came (``--json`` prints it,
the demo's summary keeps it): the types say what a caller may read without changing what it
holds. Numbers the sidecar could not measure come as the strings "nan", "inf" or "-inf" where
the server writes them so (windows, evidence), hence ``float | str`` there.

No ``from __future__ import annotations`` here: a TypedDict reads ``NotRequired`` from its
evaluated annotations (``__optional_keys__``), which the tests hold the bodies to.
"""

from typing import Any, NotRequired, TypedDict

from tuner import KnobValue


class ConfigJSON(TypedDict):
    """A config: knob values with the version they were issued under."""

    version: int
    values: dict[str, KnobValue]


class KnobJSON(TypedDict):
    """One knob of a job (fields that are unset on the knob are left out)."""

    name: str
    default: KnobValue
    choices: NotRequired[list[KnobValue]]
    low: NotRequired[float]
    high: NotRequired[float]
    integer: bool
    log: bool
    scope: str
    risk: str
    risky_values: list[KnobValue]
    search_excludes: list[KnobValue]
    searchable: bool
    description: str


class WindowJSON(TypedDict):
    """What one config version measured in a trial's window."""

    version: int
    arm: str
    steps: int
    step_s: float | str
    tokens_per_s: float | str
    loss: float | str
    nonfinite_loss: bool
    start_ns: int
    end_ns: int
    p99_s: float | str
    quality: float | str
    quality_tokens: int
    step_cv: float | str


class ComparisonJSON(TypedDict):
    """A trial's verdict in numbers: the candidate's relative gain and its interval."""

    pairs: int
    gain: float
    ci_low: float
    ci_high: float
    width: float
    confidence: float
    loss_excess: float
    loss_ok: bool
    latency_excess: float
    latency_ok: bool
    quality: float
    quality_tokens: int
    quality_ok: bool
    pair_ratios: list[float]


class ChangeJSON(TypedDict):
    """A change (config A -> B of one job) as the journal holds it."""

    id: str
    job: str
    state: str
    source: str
    reason: str
    risk: str
    scope: str
    values: dict[str, KnobValue]
    baseline: dict[str, KnobValue]
    created_at_s: float
    expires_at_s: float
    approved_by: str | None
    traceparent: str
    meta: dict[str, Any]
    spans: dict[str, dict[str, Any]]
    plan: dict[str, Any]
    windows: list[WindowJSON]
    comparison: ComparisonJSON | None


class EventJSON(TypedDict):
    """One row of the audit log."""

    seq: int
    change_id: str | None
    job: str
    at_ns: int
    kind: str
    from_state: str | None
    to_state: str | None
    actor: str
    reason: str
    version_before: int | None
    version_after: int | None
    detail: dict[str, Any]


class ChangeDetailJSON(ChangeJSON):
    """A change with its audit trail."""

    events: list[EventJSON]


class ChangeRefJSON(TypedDict):
    """The change a job has in flight, by id and state."""

    id: str
    state: str


class StatusJobJSON(TypedDict):
    """One job in the sidecar's status: attached or configured, with its versions and mode."""

    job: str
    state: str
    kind: str | None
    desired_version: int | None
    baseline_version: int | None
    acked_version: int | None
    last_step: int | None
    mode: str
    tuning: str
    change: ChangeRefJSON | None


class SidecarInfoJSON(TypedDict):
    """Where the sidecar listens and keeps its files."""

    job: str
    listen: str
    ready: bool
    store: str
    state_db: str


class StatusJSON(TypedDict):
    """The sidecar at a glance: its jobs, open findings and changes counted, who waits."""

    sidecar: SidecarInfoJSON
    jobs: list[StatusJobJSON]
    findings: dict[str, int]
    changes: dict[str, int]
    waiting: list[str]
    webhook: dict[str, Any]


class LeaseJobJSON(TypedDict):
    """A job as the lease registry sees it (``GET /v1/jobs``)."""

    job: str
    kind: str
    world_size: int
    state: str
    lease_ttl_s: float
    expires_in_s: float
    knobs: list[KnobJSON]
    baseline: ConfigJSON
    desired: ConfigJSON
    change_id: str | None
    acked_version: int | None
    last_step: int | None
    fingerprint: dict[str, Any] | None
    """What the job sent at attach for the fleet priors (``collectors.JobFingerprint``)."""


class KnobsJSON(TypedDict):
    """A job's knobs with its baseline and desired configs and its search's state."""

    job: str
    knobs: list[KnobJSON]
    baseline: ConfigJSON
    desired: ConfigJSON
    acked_version: int | None
    mode: str
    tuning: str
    moves_left: int | None


class AckJSON(TypedDict):
    """What the job reported at a step boundary, one-shot actions with their outcome."""

    version: int
    step: int
    status: str
    error: str | None
    actions: list[dict[str, Any]]
    time_s: float


class EvidenceJSON(TypedDict):
    """Why a finding opened: the numbers and the model that judged them."""

    summary: str
    model: str
    measurements: list[dict[str, Any]]
    thresholds: list[dict[str, Any]]


class FindingJSON(TypedDict):
    """A detector's verdict on a job."""

    id: str
    detector: str
    job: str
    resource: dict[str, str]
    severity: str
    opened_at_ns: int | None
    closed_at_ns: int | None
    evidence: EvidenceJSON
    suggested_changes: list[dict[str, Any]]


class TuningJSON(TypedDict):
    """A job's search after pause or resume: ``off``, ``paused`` or ``running``."""

    job: str
    tuning: str


class ReadinessJSON(TypedDict):
    """``/readyz``: ready or not, and why not."""

    ready: bool
    job: str
    reasons: list[str]
