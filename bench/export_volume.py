"""Benchmark: what one export of a job costs after it went through many config versions.

Every point carries ``seedance.config.version``, so each version opens a new stream of every
instrument. The SDK alone re-exports every stream at every collection (cumulative sums and
histograms, and synchronous gauges' last values); ``collectors._changed_points`` sends only
streams that changed (DELTA gauges, unchanged cumulative points dropped).

The instrument mix is SIMULATED but shaped like the demo GPT's training instrumentation per
version: two step histograms (step and data-wait durations), a non-finite-steps counter, nine
per-step gauges and three per-module-group gauges over five groups. Each "step" records all of
them under the current version; the version changes every ``--steps-per-version`` steps and an
export follows every ``--steps-per-export`` steps. Both arms run the same recordings
interleaved (A B A B ...), and the sink decodes every export with the receiver's decoder, as
the sidecar's store path does.

Reported: points per export and export wall time (median) at the first and last version, for
the SDK alone and with the filter, and their ratios. Results go to
bench/results/export_volume.json.

Run: python bench/export_volume.py  [--versions 40]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult  # noqa: E402

from bench._targets import Target, at_most, judged  # noqa: E402
from collectors._changed_points import GAUGE_TEMPORALITY, ChangedPointsExporter  # noqa: E402
from collectors._otel import StoreMetricExporter  # noqa: E402
from collectors._otlp_decode import DecodedMetrics  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "export_volume.json"
GAUGES = ("loss", "tokens_per_second", "samples_per_second", "learning_rate", "grad.norm",
          "step", "loss_scale", "accumulation", "micro_batch")
GROUP_GAUGES = ("grad.group_norm", "grad.zero_fraction", "grad.nonfinite")
GROUPS = ("embedding", "attention", "ffn", "norm", "head")


class Arm:
    """One provider whose export goes to a counting sink, with or without the filter."""

    def __init__(self, *, filtered: bool) -> None:
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        self.points: list[int] = []
        self.exported: list[int] = []
        store = StoreMetricExporter(self._sink)
        self.exporter: MetricExporter = ChangedPointsExporter(store) if filtered else store
        self.reader = InMemoryMetricReader(
            preferred_temporality=GAUGE_TEMPORALITY if filtered else None)
        self.provider = MeterProvider(metric_readers=[self.reader])
        meter = self.provider.get_meter("bench.export_volume")
        self.histograms = [meter.create_histogram(f"seedance.train.{n}.duration", unit="s")
                           for n in ("step", "data_wait")]
        self.counter = meter.create_counter("seedance.train.nonfinite_steps")
        self.gauges = {n: meter.create_gauge(f"seedance.train.{n}") for n in GAUGES}
        self.group_gauges = {n: meter.create_gauge(f"seedance.train.{n}") for n in GROUP_GAUGES}

    def _sink(self, decoded: DecodedMetrics) -> None:
        self.exported.append(len(decoded.points))

    def step(self, version: int, i: int) -> None:
        attrs = {"seedance.config.version": str(version)}
        for h in self.histograms:
            h.record(0.1 + 0.001 * (i % 7), attrs)
        self.counter.add(0, attrs)
        for name, gauge in self.gauges.items():
            gauge.set(float(i + len(name)), attrs)
        for name, gauge in self.group_gauges.items():
            for group in GROUPS:
                gauge.set(float(i + len(name)), {**attrs, "seedance.module_group": group})

    def export(self) -> tuple[int, float]:
        start = time.perf_counter()
        data = self.reader.get_metrics_data()
        result = (self.exporter.export(data) if data is not None
                  else MetricExportResult.SUCCESS)
        elapsed = time.perf_counter() - start
        assert result == MetricExportResult.SUCCESS
        return (self.exported[-1] if self.exported else 0), elapsed


def targets(report: dict[str, Any]) -> list[Target]:
    """With the filter an export stays as small at the last version as at the first.

    No issue states a target for this bench; its purpose (docstring) is that frozen
    config-version streams are not re-exported, so the volume does not grow with versions.
    """
    filtered = report["filtered"]
    return [at_most("filtered points per export, last version", filtered["first_version"][
        "points_per_export"], filtered["last_version"]["points_per_export"],
        "bench docstring (only streams that changed are sent); the first version's figure "
        "is the target")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--steps-per-version", type=int, default=30)
    parser.add_argument("--steps-per-export", type=int, default=5)
    args = parser.parse_args()
    arms = {"sdk": Arm(filtered=False), "filtered": Arm(filtered=True)}
    per_version: dict[str, dict[int, list[tuple[int, float]]]] = {k: {} for k in arms}
    i = 0
    for version in range(1, args.versions + 1):
        for _ in range(args.steps_per_version // args.steps_per_export):
            for name, arm in (arms.items() if i % 2 == 0 else reversed(arms.items())):
                for k in range(args.steps_per_export):
                    arm.step(version, i * args.steps_per_export + k)
                per_version[name].setdefault(version, []).append(arm.export())
            i += 1

    def figures(name: str, version: int) -> dict[str, float]:
        rows = per_version[name][version]
        return {"points_per_export": statistics.median(p for p, _ in rows),
                "export_ms": round(1000 * statistics.median(t for _, t in rows), 3)}

    first, last = 1, args.versions
    report: dict[str, Any] = {
        "bench": "export_volume", "simulated": "instrument mix shaped like the demo GPT's",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "args": vars(args),
        "sdk": {"first_version": figures("sdk", first), "last_version": figures("sdk", last)},
        "filtered": {"first_version": figures("filtered", first),
                     "last_version": figures("filtered", last)},
    }
    for key in ("points_per_export", "export_ms"):
        report[f"{key}_filtered_over_sdk_at_last_version"] = round(
            report["filtered"]["last_version"][key] / report["sdk"]["last_version"][key], 4)
    for arm in arms.values():
        arm.provider.shutdown()
    report = judged(report, targets(report))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
