"""Where the sidecar reads series from (``metrics_source``): its embedded store, or a Prometheus
that scrapes the sidecars' /metrics.

A Prometheus sample is one scrape late and stands for every export until the next scrape, so a
window holds whole scrapes only when it is longer than two scrape intervals: the sidecar learns
the interval from Prometheus before it starts and refuses windows that are not, and its reader
never answers for the last scrape interval (a scrape stamped in it may not have landed yet).
"""

from __future__ import annotations

from collectors import ConfigError, PrometheusError, PrometheusSource
from seedancectl._config import SidecarConfig

SCRAPES_PER_WINDOW = 2
"""A window must be longer than this many scrape intervals."""
READ_TIMEOUT_S = 10.0
"""Deadline of one read: the engine and the tuning thread wait for it."""


def prometheus_reader(config: SidecarConfig) -> PrometheusSource | None:
    """The reader ``metrics_source`` names, None for the embedded store; a Prometheus that
    cannot say its scrape interval, or a window too short for it, is one ConfigError line."""
    url = config.prometheus_url
    if url is None:
        return None
    try:
        with PrometheusSource(url, timeout_s=READ_TIMEOUT_S) as probe:
            interval_s = probe.scrape_interval_s()
    except PrometheusError as exc:
        raise ConfigError(f"metrics_source: {exc}") from None
    rollout = config.rollout
    least_s = SCRAPES_PER_WINDOW * interval_s
    for setting, window_s in (("rollout.min_window_s", rollout.min_window_s),
                              ("policy_window_s", config.policy_window_s)):
        if not window_s > least_s:
            raise ConfigError(
                f"{setting} = {window_s:g} s is not longer than {SCRAPES_PER_WINDOW} scrape "
                f"intervals of Prometheus at {url} ({SCRAPES_PER_WINDOW} x {interval_s:g} s): "
                f"a window would miss scrapes; make it more than {least_s:g} s")
    # A config version lives from its send to its ack and its window's end at the latest, so
    # reading that far back finds every point of the version a measurement or guardrail asks.
    return PrometheusSource(url, timeout_s=READ_TIMEOUT_S, settle_s=interval_s,
                            lookback_s=rollout.ack_timeout_s + rollout.window_timeout_s
                            + least_s)
