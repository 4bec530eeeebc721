"""Detectors: each reads one window of a job's telemetry and returns findings with evidence."""

from policies.detectors._balance import (
    AutoscalerThrashDetector,
    ImbalanceConfig,
    LoadImbalanceDetector,
    ThrashConfig,
    rebalance_weight,
)
from policies.detectors._bandwidth import BandwidthConfig, BandwidthSaturationDetector
from policies.detectors._communication import (
    CommunicationConfig,
    CommunicationDegradationDetector,
    TinyBucketConfig,
    TinyBucketDetector,
    nvlink_peak_bytes_per_s,
)

__all__ = [
    "AutoscalerThrashDetector",
    "BandwidthConfig",
    "BandwidthSaturationDetector",
    "CommunicationConfig",
    "CommunicationDegradationDetector",
    "ImbalanceConfig",
    "LoadImbalanceDetector",
    "ThrashConfig",
    "TinyBucketConfig",
    "TinyBucketDetector",
    "nvlink_peak_bytes_per_s",
    "rebalance_weight",
]
