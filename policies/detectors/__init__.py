"""Detectors: each reads one window of a job's telemetry and returns findings with evidence."""

from policies.detectors._balance import (
    AutoscalerThrashDetector,
    ImbalanceConfig,
    LoadImbalanceDetector,
    ThrashConfig,
    p99_per_interval,
    rebalance_weight,
)
from policies.detectors._bandwidth import BandwidthConfig, BandwidthSaturationDetector
from policies.detectors._collapse import (
    CollapseConfig,
    GradientCollapseDetector,
    article_collapse_step,
)
from policies.detectors._communication import (
    CommunicationConfig,
    CommunicationDegradationDetector,
    TinyBucketConfig,
    TinyBucketDetector,
    nvlink_peak_bytes_per_s,
)
from policies.detectors._gradient_parts import COLLAPSE, NON_FINITE, UNDERFLOW, locate_cause
from policies.detectors._input import InputBoundConfig, InputBoundDetector
from policies.detectors._nonfinite import NonFiniteConfig, NonFiniteDetector
from policies.detectors._precision import SmallBatchPrecisionConfig, SmallBatchPrecisionDetector
from policies.detectors._priors import (
    EXPECTED_GAIN,
    ComputePriorsConfig,
    ComputePriorsDetector,
    amdahl_speedup,
)
from policies.detectors._series import interval_increases
from policies.detectors._serving import (
    KvDecompressionConfig,
    KvDecompressionCostDetector,
    LowCacheHitConfig,
    LowCacheHitRateDetector,
)
from policies.detectors._steps import BATCH_SIZE_ATTR, PRECISION_ATTR
from policies.detectors._underflow import GradientUnderflowDetector, UnderflowConfig

__all__ = [
    "COLLAPSE",
    "NON_FINITE",
    "UNDERFLOW",
    "AutoscalerThrashDetector",
    "BATCH_SIZE_ATTR",
    "BandwidthConfig",
    "BandwidthSaturationDetector",
    "CollapseConfig",
    "CommunicationConfig",
    "CommunicationDegradationDetector",
    "ComputePriorsConfig",
    "ComputePriorsDetector",
    "EXPECTED_GAIN",
    "GradientCollapseDetector",
    "GradientUnderflowDetector",
    "ImbalanceConfig",
    "InputBoundConfig",
    "InputBoundDetector",
    "KvDecompressionConfig",
    "KvDecompressionCostDetector",
    "LoadImbalanceDetector",
    "LowCacheHitConfig",
    "LowCacheHitRateDetector",
    "NonFiniteConfig",
    "NonFiniteDetector",
    "PRECISION_ATTR",
    "SmallBatchPrecisionConfig",
    "SmallBatchPrecisionDetector",
    "ThrashConfig",
    "TinyBucketConfig",
    "TinyBucketDetector",
    "UnderflowConfig",
    "amdahl_speedup",
    "interval_increases",
    "locate_cause",
    "nvlink_peak_bytes_per_s",
    "p99_per_interval",
    "rebalance_weight",
    "article_collapse_step",
]
